"""The tensor table that checkpoint_tools/inspect.py prints, from headers and metadata only (no
Megatron import): an HF safetensors dir's names, shapes, dtypes and files, or a Megatron dist
checkpoint's with the number of saved chunks per tensor and the layout it was written with.
"""
from __future__ import annotations

import json
import os
import sys

from dapo_megatron.train.integrity import check
from dapo_megatron.weights.hf_io import CheckpointError, HFCheckpoint


def run(args) -> int:
    """The parsed command line of inspect.py: print the table (and check the files with
    --check); the exit code (2 with one `error:` line on bad input)."""
    try:
        print(inspect(args.path, args.filter))
        if args.check:
            check(args.path)
            print("check: OK")
    except (CheckpointError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def hf_rows(path: str) -> tuple[list[tuple], str]:
    ckpt = HFCheckpoint(path)
    rows = []
    for name in sorted(ckpt.keys()):
        sl = ckpt.tensor_slice(name)
        rows.append((name, list(sl.get_shape()), sl.get_dtype(), ckpt.weight_map[name]))
    cfg = {}
    if os.path.exists(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
    keys = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "num_experts", "num_local_experts", "tie_word_embeddings", "dtype", "torch_dtype")
    summary = ", ".join(f"{k}={cfg[k]}" for k in keys if k in cfg)
    return rows, f"HF checkpoint ({len(set(ckpt.weight_map.values()))} files): {summary}"


def mcore_rows(path: str) -> tuple[list[tuple], str]:
    from torch.distributed.checkpoint import FileSystemReader  # ~1.5 s of imports an HF dir does without
    meta = FileSystemReader(path).read_metadata()
    rows = []
    for key in sorted(meta.state_dict_metadata):
        md = meta.state_dict_metadata[key]
        if hasattr(md, "size"):  # a tensor (not a bytes / object entry)
            rows.append((key, list(md.size), str(md.properties.dtype).replace("torch.", ""),
                         f"{len(md.chunks)} chunks"))
        # non-tensor entries (e.g. per-expert `_extra_state` objects) are left out of the table
    info = ""
    extra = os.path.join(path, "dapo_megatron.json")
    if os.path.exists(extra):
        with open(extra) as f:
            m = json.load(f)
        info = f", written at {m.get('layout')} in {m.get('dtype')}"
    manifest = os.path.join(path, "checksums.json")
    if os.path.exists(manifest):
        with open(manifest) as f:
            info += f"; checksums.json lists {len(json.load(f)['crc32'])} files (--check reads them)"
    return rows, f"Megatron dist checkpoint (torch_dist){info}"


def inspect(path: str, needle: str = "") -> str:
    if os.path.exists(os.path.join(path, ".metadata")):
        rows, title = mcore_rows(path)
    else:
        rows, title = hf_rows(path)
    rows = [r for r in rows if needle in r[0]]
    width = max([len(r[0]) for r in rows] + [4])
    lines = [title, f"{'name':<{width}}  {'shape':<20} {'dtype':<9} layout/file"]
    total = 0
    for name, shape, dtype, where in rows:
        lines.append(f"{name:<{width}}  {str(shape):<20} {dtype:<9} {where}")
        n = 1
        for d in shape:
            n *= d
        total += n
    lines.append(f"{len(rows)} tensors, {total:,} elements")
    return "\n".join(lines)
