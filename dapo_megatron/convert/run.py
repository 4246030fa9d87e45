"""The convert command once its arguments parse, in the command's own process: check the input
against the model, launch the ranks (ranks.py) on a temporary folder next to --out, check what
they wrote and rename it into place. Also the layout checks and device choice that
checkpoint_tools/verify.py and tools/check_sync share.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys

from dapo_megatron.config.schema import ParallelConfig
from dapo_megatron.config.validate import check_parallel, check_parallel_fits_model
from dapo_megatron.convert.ranks import hf_to_mcore_worker, mcore_to_hf_worker
from dapo_megatron.convert.usage import UsageError, log_path
from dapo_megatron.device import detect, get_device
from dapo_megatron.dtypes import BY_ANY_NAME, DTYPES
from dapo_megatron.models import ModelSpec
from dapo_megatron.train import integrity
from dapo_megatron.train.parallel import WorkerError, run_workers
from dapo_megatron.weights import hf_io
from dapo_megatron.weights.hf_io import CheckpointError, finalize_shards
from dapo_megatron.weights.load import check_hf_checkpoint

META_FILE = "dapo_megatron.json"  # layout and dtype the checkpoint was written with
_OPTIMIZER_KEY = re.compile(r"(chained_\d+\.)?optimizer\.")  # a training checkpoint's Adam state


def convert(args) -> int:
    """Run the parsed command line; the exit code (2 with one `error:` line on bad input)."""
    try:
        out = (hf_to_mcore if args.command == "hf-to-mcore" else mcore_to_hf)(args)
    except (UsageError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except WorkerError as e:
        print(f"error: {e}", file=sys.stderr)
        if args.verbose:
            print(e.details, file=sys.stderr)
        print(f"library output of the workers: {log_path(args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; nothing written", file=sys.stderr)
        return 130
    print(f"wrote {out}")
    return 0


def checked_layout(layout: dict, spec) -> dict:
    """A --tp/--pp/--ep/--etp layout, checked against the model by the config's own rules (the
    convert and verify tools)."""
    parallel, flag = ParallelConfig(**layout), lambda name: f"--{name}"
    check_parallel(parallel, world_for_layout(layout) if min(layout.values()) >= 1 else 1, flag, "worker ranks")
    check_parallel_fits_model(parallel, spec, flag, trains=False)
    return layout


def world_for_layout(layout: dict) -> int:
    """Smallest world that fits both the dense (tp*pp) and the expert (etp*ep*pp) layouts."""
    dense, expert = layout["tp"] * layout["pp"], layout["etp"] * layout["ep"] * layout["pp"]
    return dense * expert // math.gcd(dense, expert)


def pick_device(kind: str, world: int) -> str:
    """The device the `world` conversion workers run on: one accelerator each, else the CPU.

    Conversion only moves tensors, so on a host with fewer accelerators than the layout has
    ranks `auto` converts on the CPU (gloo) rather than failing on a missing device ordinal.
    """
    resolved = detect() if kind == "auto" else kind
    have = get_device(resolved).count()
    if resolved == "cpu" or have >= world:
        return resolved
    if kind != "auto":
        raise UsageError(f"--device {kind}: the layout needs {world} worker processes, one {kind} device each, "
                         f"and this host has {have}; use --device cpu (or auto)")
    print(f"convert: the layout needs {world} processes and this host has {have} {resolved} devices; "
          "converting on the CPU (gloo)", file=sys.stderr)
    return "cpu"


def _temp_dir(out: str, force: bool) -> str:
    out = os.path.abspath(out)
    if os.path.exists(out) and not force:
        raise UsageError(f"{out} exists; pass --force to overwrite it")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise UsageError(f"the parent folder of --out, {parent}, does not exist")
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def _publish(tmp: str, out: str) -> None:
    out = os.path.abspath(out)
    if os.path.exists(out):
        shutil.rmtree(out) if os.path.isdir(out) else os.remove(out)
    os.replace(tmp, out)


def copy_aux(src: str, dst: str, dtype: str | None = None) -> None:
    """Copy config / tokenizer files; with `dtype`, record it in config.json."""
    hf_io.copy_hf_files(src, dst)
    if dtype:
        path = os.path.join(dst, "config.json")
        cfg = _read_json(path)
        cfg["dtype"] = DTYPES[dtype].hf
        if "torch_dtype" in cfg:  # the transformers 4 name of the same field
            cfg["torch_dtype"] = DTYPES[dtype].hf
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)


def _read_json(path: str, key: str | None = None):
    """A JSON file (or its `key`); a broken one is a UsageError naming it."""
    try:
        with open(path) as f:
            data = json.load(f)
        return data if key is None else data[key]
    except (ValueError, KeyError, TypeError) as e:
        what = f"has no {key!r}" if isinstance(e, (KeyError, TypeError)) else f"is not valid JSON ({e})"
        raise UsageError(f"{path} {what}") from None


def _hf_dtype(hf_dir: str) -> str:
    """Our name of an HF checkpoint's dtype (fp32 when config.json names none we know)."""
    cfg = _read_json(os.path.join(hf_dir, "config.json"))
    hf_name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").lower()
    return BY_ANY_NAME.get(hf_name, DTYPES["fp32"]).name


def _ckpt_dtype(ckpt: str, hf_config: str) -> str:
    """The dtype a Megatron checkpoint was written in (our metadata file, else the HF config)."""
    meta = os.path.join(ckpt, META_FILE)
    if not os.path.exists(meta):
        return _hf_dtype(hf_config)
    return _read_json(meta, "dtype")


def _no_hf_files(ckpt: str) -> str:
    """A checkpoint without its hf/ folder (written before training checkpoints carried one): say
    which flag to add, and the model the run trained from when its config.yaml says."""
    run_config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(ckpt))), "config.yaml")
    model = ""
    if os.path.exists(run_config):
        from omegaconf import OmegaConf
        model = str(OmegaConf.select(OmegaConf.load(run_config), "model.path", default="") or "")
    hint = f" (the run's {run_config} says model.path={model})" if model else ""
    return (f"{ckpt} has no {hf_io.HF_SUBDIR}/ folder with the model's config and tokenizer: pass --hf-config <the HF "
            f"folder of the model it was trained from>{hint}")


def _check_hf_dir(hf_dir: str) -> None:
    if not os.path.isdir(hf_dir):
        raise UsageError(f"HF checkpoint dir {hf_dir} does not exist")
    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        raise UsageError(f"{hf_dir} has no config.json")


def hf_to_mcore(args) -> str:
    _check_hf_dir(args.hf_dir)
    spec = ModelSpec.from_pretrained(args.hf_dir)
    layout = checked_layout(dict(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp), spec)
    check_hf_checkpoint(args.hf_dir, spec)  # fail fast, before any worker starts
    dtype = _hf_dtype(args.hf_dir) if args.dtype == "keep" else args.dtype
    tmp = _temp_dir(args.out, args.force)
    try:
        world = world_for_layout(layout)
        run_workers(hf_to_mcore_worker, world, os.path.abspath(args.hf_dir), spec, tmp, layout, dtype,
                    pick_device(args.device, world), timeout_s=args.timeout, log_path=log_path(args))
        copy_aux(args.hf_dir, os.path.join(tmp, hf_io.HF_SUBDIR), dtype)
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump({"format": "megatron-core dist_checkpointing torch_dist", "layout": layout,
                       "dtype": dtype, "state_dict_key": "model"}, f, indent=2)
        _publish(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return args.out


def mcore_to_hf(args) -> str:
    if not os.path.isdir(args.ckpt) or not os.path.exists(os.path.join(args.ckpt, "metadata.json")):
        raise UsageError(f"{args.ckpt} is not a Megatron dist checkpoint (no metadata.json)")
    hf_config = args.hf_config or os.path.join(args.ckpt, hf_io.HF_SUBDIR)
    if not args.hf_config and not os.path.isdir(hf_config):
        raise UsageError(_no_hf_files(args.ckpt))
    _check_hf_dir(hf_config)
    dtype = _ckpt_dtype(args.ckpt, hf_config) if args.dtype == "keep" else args.dtype
    spec = ModelSpec.from_pretrained(hf_config)  # read once here; the workers get it with their arguments
    layout = checked_layout(dict(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp), spec)
    integrity.check(args.ckpt)  # every file's size and CRC32, while the workers import
    tensors = _tensor_keys(args.ckpt)
    tmp = _temp_dir(args.out, args.force)
    try:
        world = world_for_layout(layout)
        results = run_workers(mcore_to_hf_worker, world, os.path.abspath(args.ckpt), spec,
                              tmp, layout, dtype, args.shard_mb << 20, pick_device(args.device, world),
                              timeout_s=args.timeout, log_path=log_path(args))
        _check_all_loaded(args.ckpt, hf_config, tensors, set().union(*(r["keys"] for r in results)))
        weight_map, total = {}, 0
        for r in results:
            weight_map.update(r.get("weight_map", {}))
            total += r.get("total_bytes", 0)
        finalize_shards(tmp, weight_map, total)
        copy_aux(hf_config, tmp, dtype)
        _publish(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return args.out


def _tensor_keys(ckpt: str) -> set[str]:
    """The model tensors a dist checkpoint holds (without a training checkpoint's optimizer state).
    torch's checkpoint reader is imported here, on the mcore-to-hf path only (~1.5 s of CPU)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    return {k for k, v in meta.items() if isinstance(v, TensorStorageMetadata) and not _OPTIMIZER_KEY.match(k)}


def _check_all_loaded(ckpt: str, hf_config: str, tensors: set[str], loaded: set[str]) -> None:
    """A checkpoint tensor that no rank loaded would be dropped from the export without a word:
    the HF config describes another model (e.g. tied embeddings where the checkpoint has an
    output layer). A tensor the model needs and the checkpoint lacks already fails the load."""
    unused = sorted(tensors - loaded)
    if unused:
        raise CheckpointError(f"{ckpt} holds {len(unused)} tensor(s) that the model of "
                              f"{os.path.join(hf_config, 'config.json')} has no place for: {', '.join(unused[:3])}"
                              f"{' ...' if len(unused) > 3 else ''}; pass the --hf-config it was written from")
