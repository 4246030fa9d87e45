"""List the tensors of a checkpoint: names, shapes, dtypes and layout.

    python checkpoint_tools/inspect.py DIR [--filter SUBSTRING] [--check]

DIR is an HF safetensors dir (config.json + model*.safetensors) or a Megatron dist checkpoint
(torch_dist: metadata.json + .metadata); for the latter the layout column gives the number of
saved chunks per tensor and the layout (TP/PP/EP) the checkpoint was written with, if known.
Reads headers and metadata only: fast on any checkpoint size, no Megatron import. `--check`
also reads every file of a dist checkpoint against its checksums.json (`train/integrity.py`).
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: the repo root replaces this folder on sys.path,
    # which would otherwise shadow the standard library's `inspect` with ours
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import json


def hf_rows(path: str) -> tuple[list[tuple], str]:
    from dapo_megatron.weights.hf_io import HFCheckpoint
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
    from torch.distributed.checkpoint import FileSystemReader
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--filter", default="", help="only names containing this substring")
    p.add_argument("--check", action="store_true", help="dist checkpoint: also check every file's size and "
                   "CRC32 against checksums.json (reads every byte)")
    args = p.parse_args(argv)
    from dapo_megatron.weights.hf_io import CheckpointError
    try:
        print(inspect(args.path, args.filter))
        if args.check:
            from dapo_megatron.train.integrity import check
            check(args.path)
            print("check: OK")
    except (CheckpointError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
