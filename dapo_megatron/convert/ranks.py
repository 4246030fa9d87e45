"""What each rank of `python -m dapo_megatron.convert` runs (started by run.py through
`train.parallel.run_workers`): build the model at the layout, load it, then save the dist
checkpoint or export HF shards; and the storage helpers that keep a rank's peak memory near its
shard.

The command's own process imports this module too, to hand these functions to its ranks; so
Megatron is imported inside the functions that use it: the ranks have it from the forkserver's
preload, and the command never pays its import (~5 s of CPU).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from tqdm import tqdm

from dapo_megatron.config.schema import ParallelConfig
from dapo_megatron.device import get_device
from dapo_megatron.logs import console
from dapo_megatron.models import build_model
from dapo_megatron.train.checkpoint import dist_save
from dapo_megatron.train.integrity import write_manifest
from dapo_megatron.train.parallel import init_parallel
from dapo_megatron.weights import load_hf_checkpoint
from dapo_megatron.weights.export import write_hf_shards
from dapo_megatron.weights.hf_io import CheckpointError


def hf_to_mcore_worker(hf_dir: str, spec, out_dir: str, layout: dict, dtype: str, device: str) -> None:
    dev = get_device(device)
    init_parallel(ParallelConfig(**layout), dev)
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
    t = t.detach()
    if t.device.type != "cpu" or t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    if not t.is_contiguous() or t.numel() == 0:
        return t.clone()
    raw = t.reshape(-1).view(torch.uint8).numpy()  # numpy has no bfloat16: go through bytes
    return torch.from_numpy(raw).view(t.dtype).view(t.shape)


def mcore_to_hf_worker(ckpt: str, spec, out_dir: str, layout: dict, dtype: str,
                       shard_bytes: int, device: str) -> dict:
    """Load the dist checkpoint at `layout`, export; one writer per pipeline stage."""
    dev = get_device(device)
    init_parallel(ParallelConfig(**layout), dev)
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
    if not (isinstance(pieces, (list, tuple)) and pieces and data.is_contiguous()):
        return False
    ptr, rows = data.data_ptr(), 0
    for p in pieces:
        if not (isinstance(p, torch.Tensor) and p.is_contiguous() and p.data_ptr() == ptr
                and p.dtype == data.dtype and p.shape[1:] == data.shape[1:]):
            return False
        ptr, rows = ptr + p.numel() * p.element_size(), rows + p.shape[0]
    return rows == data.shape[0]
