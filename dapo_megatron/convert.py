"""Convert checkpoints between HF safetensors and Megatron-Core distributed checkpoints.

    python -m dapo_megatron.convert hf-to-mcore --hf-dir HF --out CKPT --tp 2 --ep 2
    python -m dapo_megatron.convert mcore-to-hf --ckpt CKPT --out HF2

The tool launches its own worker processes for the requested layout (gloo on CPU, the
accelerator when present). A Megatron checkpoint written at one layout loads at any other
(dist_checkpointing reshards). Output goes to a temporary folder next to --out, renamed when
complete, so an error never leaves a partial checkpoint. Bad input exits with code 2 and one
line naming the tensor or file. Megatron is imported only inside the workers, so --help is fast.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys

META_FILE = "dapo_megatron.json"  # layout and dtype the checkpoint was written with
_OPTIMIZER_KEY = re.compile(r"(chained_\d+\.)?optimizer\.")  # a training checkpoint's Adam state


class UsageError(Exception):
    """Bad command line or input: reported as one line, exit code 2."""


# --------------------------------------------------------------------------------------------
# Worker side (runs in each spawned rank).


def _parallel(layout: dict):
    from dapo_megatron.config.schema import ParallelConfig
    return ParallelConfig(**layout)


def _hf_to_mcore_worker(hf_dir: str, spec, out_dir: str, layout: dict, dtype: str, device: str) -> None:
    from dapo_megatron.device import get_device
    from dapo_megatron.models import build_model
    from dapo_megatron.train.checkpoint import dist_save
    from dapo_megatron.train.integrity import write_manifest
    from dapo_megatron.train.parallel import init_parallel
    from dapo_megatron.weights import load_hf_checkpoint
    dev = get_device(device)
    init_parallel(_parallel(layout), dev)
    # Every parameter is overwritten by the load: skip Megatron's random init, which on CPU
    # builds each full (unsharded) weight on every rank before slicing it.
    chunks = build_model(spec, dtype=dtype, perform_initialization=False,
                         device=dev)
    load_hf_checkpoint(chunks, hf_dir, progress=True, adopt=True)
    dist_save({"model": _own_storage(chunks[0])}, out_dir)
    write_manifest(out_dir)


def _own_storage(chunk) -> dict:
    """The chunk's sharded state dict with each CPU tensor in a storage of exactly its bytes.

    torch_dist saves a tensor with torch.save, which writes a view's whole storage, so megatron
    clones every CPU view (each expert's gate and up halves of fc1, a row slice of a
    memory-mapped HF tensor) before writing: all at once, ~1.5x the shard at peak.
    `_exact_storage` gives a contiguous view an alias of its bytes instead, with no copy.
    """
    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    sharded = chunk.sharded_state_dict()
    apply_factories(sharded)
    for sh in nested_values(sharded):
        if isinstance(sh, ShardedTensor) and isinstance(sh.data, torch.Tensor):
            sh.data = _exact_storage(sh.data)
    return sharded


def _exact_storage(t):
    """`t`, or its values in a storage of exactly their bytes: for a contiguous CPU view an alias
    of its memory (torch.from_numpy makes a storage of the array's extent, which holds a
    reference to the original), for a strided one a clone. A device tensor is left alone: the
    writer copies just its values to the host."""
    import torch
    t = t.detach()
    if t.device.type != "cpu" or t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    if not t.is_contiguous() or t.numel() == 0:
        return t.clone()
    raw = t.reshape(-1).view(torch.uint8).numpy()  # numpy has no bfloat16: go through bytes
    return torch.from_numpy(raw).view(t.dtype).view(t.shape)


def _mcore_to_hf_worker(ckpt: str, spec, out_dir: str, layout: dict, dtype: str,
                        shard_bytes: int, device: str) -> dict:
    """Load the dist checkpoint at `layout`, export; one writer per pipeline stage."""
    import torch.distributed as dist
    from tqdm import tqdm

    from dapo_megatron.device import get_device
    from dapo_megatron.logs import console
    from dapo_megatron.models import build_model
    from dapo_megatron.train.parallel import init_parallel
    from dapo_megatron.weights.export import write_hf_shards
    dev = get_device(device)
    init_parallel(_parallel(layout), dev)
    chunks = build_model(spec, dtype=dtype, perform_initialization=False,
                         device=dev)
    state, keys = _load_in_place(chunks[0], ckpt)
    chunks[0].load_state_dict(state, strict=True)  # checks the keys; a tensor copied onto itself is skipped
    del state
    bar = tqdm(desc="export", unit="tensor", disable=dist.get_rank() != 0, file=console())
    result = write_hf_shards(chunks, out_dir, shard_bytes, on_tensor=lambda _: bar.update(1))
    bar.close()
    return {**result, "keys": keys}


def _load_in_place(chunk, ckpt: str) -> tuple[dict, set[str]]:
    """dist_checkpointing.load of the chunk into its own parameters (a collective); returns the
    state dict and the checkpoint keys it read. A load error becomes one line naming the key.

    Megatron loads a fused weight (each expert's gate/up fc1) as pieces, views of the
    parameter, then `torch.cat`s them into a new tensor: a copy of most of an MoE's weights,
    ~1.5x the stage at peak. The pieces already fill the parameter in order, so the merge here
    returns the parameter itself. (A merge it does not recognise still cats: correct, bigger.)
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from torch.distributed.checkpoint.api import CheckpointException

    from dapo_megatron.weights.hf_io import CheckpointError
    template = chunk.sharded_state_dict()
    keys = {v.key for v in nested_values(template) if isinstance(v, (ShardedTensor, ShardedTensorFactory))}
    for factory in nested_values(template):
        if isinstance(factory, ShardedTensorFactory):
            factory.merge_fn = _merge_in_place(factory.data, factory.merge_fn)
    try:
        return dist_checkpointing.load({"model": template}, ckpt).get("model", {}), keys
    except (CheckpointException, CheckpointingException) as e:  # DCP's is a BaseException
        if isinstance(e, CheckpointException):  # {rank: (exception, stack)}, each with its traceback
            e = e.failures[min(e.failures)][0]
        why = f"it has no tensor {e.args[0]}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise CheckpointError(f"cannot load {ckpt} into the model that the HF config describes: {why}") from None


def _merge_in_place(data, merge):
    def merge_fn(pieces):
        return data if _tiles(data, pieces) else merge(pieces)
    return merge_fn


def _tiles(data, pieces) -> bool:
    """Whether `pieces` are consecutive views that fill `data` in order (`torch.cat(pieces)`
    would equal `data`)."""
    import torch
    if not (isinstance(pieces, (list, tuple)) and pieces and data.is_contiguous()):
        return False
    ptr, rows = data.data_ptr(), 0
    for p in pieces:
        if not (isinstance(p, torch.Tensor) and p.is_contiguous() and p.data_ptr() == ptr
                and p.dtype == data.dtype and p.shape[1:] == data.shape[1:]):
            return False
        ptr, rows = ptr + p.numel() * p.element_size(), rows + p.shape[0]
    return rows == data.shape[0]


# --------------------------------------------------------------------------------------------
# Parent side: argument checks, temp folder, launching, finishing.


def checked_layout(layout: dict, spec) -> dict:
    """A --tp/--pp/--ep/--etp layout, checked against the model by the config's own rules (the
    convert and verify tools)."""
    from dapo_megatron.config.validate import check_parallel, check_parallel_fits_model
    parallel, flag = _parallel(layout), lambda name: f"--{name}"
    check_parallel(parallel, world_for_layout(layout) if min(layout.values()) >= 1 else 1, flag, "worker ranks")
    check_parallel_fits_model(parallel, spec, flag, trains=False)
    return layout


def world_for_layout(layout: dict) -> int:
    """Smallest world that fits both the dense (tp*pp) and the expert (etp*ep*pp) layouts."""
    import math
    dense, expert = layout["tp"] * layout["pp"], layout["etp"] * layout["ep"] * layout["pp"]
    return dense * expert // math.gcd(dense, expert)


def pick_device(kind: str, world: int) -> str:
    """The device the `world` conversion workers run on: one accelerator each, else the CPU.

    Conversion only moves tensors, so on a host with fewer accelerators than the layout has
    ranks `auto` converts on the CPU (gloo) rather than failing on a missing device ordinal.
    """
    from dapo_megatron.device import detect, get_device
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


def _copy_aux(src: str, dst: str, dtype: str | None = None) -> None:
    """Copy config / tokenizer files; with `dtype`, record it in config.json."""
    from dapo_megatron.dtypes import DTYPES
    from dapo_megatron.weights import hf_io
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
    from dapo_megatron.dtypes import BY_ANY_NAME, DTYPES
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
    from dapo_megatron.weights import hf_io
    return (f"{ckpt} has no {hf_io.HF_SUBDIR}/ folder with the model's config and tokenizer: pass --hf-config <the HF "
            f"folder of the model it was trained from>{hint}")


def _check_hf_dir(hf_dir: str) -> None:
    if not os.path.isdir(hf_dir):
        raise UsageError(f"HF checkpoint dir {hf_dir} does not exist")
    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        raise UsageError(f"{hf_dir} has no config.json")


def hf_to_mcore(args) -> str:
    from dapo_megatron.models import ModelSpec
    from dapo_megatron.train.parallel import run_workers
    from dapo_megatron.weights import hf_io
    from dapo_megatron.weights.load import check_hf_checkpoint
    _check_hf_dir(args.hf_dir)
    spec = ModelSpec.from_pretrained(args.hf_dir)
    layout = checked_layout(dict(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp), spec)
    check_hf_checkpoint(args.hf_dir, spec)  # fail fast, before any worker starts
    dtype = _hf_dtype(args.hf_dir) if args.dtype == "keep" else args.dtype
    tmp = _temp_dir(args.out, args.force)
    try:
        world = world_for_layout(layout)
        run_workers(_hf_to_mcore_worker, world, os.path.abspath(args.hf_dir), spec, tmp, layout, dtype,
                    pick_device(args.device, world), timeout_s=args.timeout, log_path=log_path(args))
        _copy_aux(args.hf_dir, os.path.join(tmp, hf_io.HF_SUBDIR), dtype)
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump({"format": "megatron-core dist_checkpointing torch_dist", "layout": layout,
                       "dtype": dtype, "state_dict_key": "model"}, f, indent=2)
        _publish(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return args.out


def mcore_to_hf(args) -> str:
    from dapo_megatron.models import ModelSpec
    from dapo_megatron.train import integrity
    from dapo_megatron.train.parallel import run_workers
    from dapo_megatron.weights import hf_io
    from dapo_megatron.weights.hf_io import finalize_shards
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
        results = run_workers(_mcore_to_hf_worker, world, os.path.abspath(args.ckpt), spec,
                              tmp, layout, dtype, args.shard_mb << 20, pick_device(args.device, world),
                              timeout_s=args.timeout, log_path=log_path(args))
        _check_all_loaded(args.ckpt, hf_config, tensors, set().union(*(r["keys"] for r in results)))
        weight_map, total = {}, 0
        for r in results:
            weight_map.update(r.get("weight_map", {}))
            total += r.get("total_bytes", 0)
        finalize_shards(tmp, weight_map, total)
        _copy_aux(hf_config, tmp, dtype)
        _publish(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return args.out


def _tensor_keys(ckpt: str) -> set[str]:
    """The model tensors a dist checkpoint holds (without a training checkpoint's optimizer state)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    return {k for k, v in meta.items() if isinstance(v, TensorStorageMetadata) and not _OPTIMIZER_KEY.match(k)}


def _check_all_loaded(ckpt: str, hf_config: str, tensors: set[str], loaded: set[str]) -> None:
    """A checkpoint tensor that no rank loaded would be dropped from the export without a word:
    the HF config describes another model (e.g. tied embeddings where the checkpoint has an
    output layer). A tensor the model needs and the checkpoint lacks already fails the load."""
    from dapo_megatron.weights.hf_io import CheckpointError
    unused = sorted(tensors - loaded)
    if unused:
        raise CheckpointError(f"{ckpt} holds {len(unused)} tensor(s) that the model of "
                              f"{os.path.join(hf_config, 'config.json')} has no place for: {', '.join(unused[:3])}"
                              f"{' ...' if len(unused) > 3 else ''}; pass the --hf-config it was written from")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dapo_megatron.convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron dist checkpoint")
    a.add_argument("--hf-dir", required=True)
    b = sub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors")
    b.add_argument("--ckpt", required=True)
    b.add_argument("--hf-config", default=None, help="HF dir with config.json (default: CKPT/hf)")
    b.add_argument("--shard-mb", type=int, default=4096, help="max size of one output file (MiB)")
    for s, verb in ((a, "write"), (b, "load")):
        s.add_argument("--out", required=True, help="output dir (written via a temp dir next to it)")
        for name, what in (("tp", "tensor"), ("pp", "pipeline"), ("ep", "expert"), ("etp", "expert-tensor")):
            s.add_argument(f"--{name}", type=int, default=1, help=f"{what} parallel degree to {verb} the "
                           "Megatron checkpoint at (any layout loads any other)")
        # dtypes.DTYPES's names, written out so that --help imports no torch (tests/unit/test_config.py)
        s.add_argument("--dtype", choices=["keep", "bf16", "fp32", "fp16"], default="keep",
                       help="dtype of the output (keep: that of the input)")
        s.add_argument("--force", action="store_true", help="overwrite an existing --out")
        s.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"], default="auto",
                       help="where the workers run (auto: one accelerator per rank if there are enough, else CPU)")
        s.add_argument("--timeout", type=float, default=3600.0, help="seconds before the workers are killed")
        s.add_argument("--verbose", action="store_true", help="print worker tracebacks on errors")
    return p


def log_path(args) -> str:
    """Where the workers' library output goes (Megatron's Apex / TE fallback warnings and the
    like): beside the output folder, so the console keeps our lines and the folder only its files."""
    return os.path.abspath(args.out).rstrip(os.sep) + ".convert.log"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from dapo_megatron.train import forkserver
    forkserver.start(log_path(args))  # the workers' imports run while this process checks the input
    from dapo_megatron.train.parallel import WorkerError
    from dapo_megatron.weights.hf_io import CheckpointError
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


def _exit_now(code: int) -> None:
    """Exit without tearing down the imported modules (torch, transformers: ~0.6-1 s of a
    command that is done). The exit handlers still run first: multiprocessing's remove the
    forkserver socket and the queue semaphores."""
    import atexit
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
