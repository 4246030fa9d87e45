"""Load an HF safetensors checkpoint into sharded Megatron model chunks, streaming.

Each rank opens the safetensors files itself and copies out only the rows / columns its own
parameters hold (`get_slice`), so no rank ever materialises the whole model. The checkpoint's
tensor names are checked against the architecture first: a missing or unknown tensor is an error
naming it, before anything is loaded.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dapo_megatron.logs import console
from dapo_megatron.parallel import coords
from dapo_megatron.weights import name_map, reshape
from dapo_megatron.weights.hf_io import CheckpointError, HFCheckpoint


def unwrap(chunk):
    """The GPTModel inside Megatron's DDP / Float16Module wrappers (their names add `module.`)."""
    while isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = chunk.module
    if not hasattr(chunk, "spec"):
        raise ValueError(f"{type(chunk).__name__} was not built by dapo_megatron.models.build_model "
                         "(no spec attribute)")
    return chunk


def chunk_geometry(chunk) -> dict:
    """Per-chunk facts the name maps and reshapes need (global layer ids, TP/ETP/EP coordinates)."""
    chunk, c = unwrap(chunk), coords()
    spec = chunk.spec
    experts_per_rank = spec.num_experts // c.ep
    return dict(
        model_type=spec.model_type, tied=spec.tie_word_embeddings, vocab_size=spec.vocab_size,
        global_layer={i: layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)},
        experts_per_rank=experts_per_rank, expert_offset=experts_per_rank * c.ep_rank,
        ep=c.ep, ep_rank=c.ep_rank, head_dim=spec.head_dim, heads=spec.num_heads, groups=spec.num_kv_heads,
        tp=(c.tp, c.tp_rank), etp=(c.etp, c.etp_rank))


def param_maps(chunk, geo: dict):
    """(ParamMap, parameter) for every parameter of a chunk, in a fixed order."""
    for name, param in unwrap(chunk).named_parameters():
        yield name_map.resolve(name, geo["model_type"], global_layer=geo["global_layer"],
                               expert_offset=geo["expert_offset"], tied=geo["tied"]), param


def tp_split(param, pm, geo) -> tuple[int | None, int, int]:
    """(partition dim or None, tp size, tp rank) of a parameter; experts use expert-TP."""
    size, rank = geo["etp"] if pm.is_expert else geo["tp"]
    if getattr(param, "tensor_model_parallel", False) and param.partition_dim != pm.tp_dim:
        raise ValueError(f"{pm.mcore_name}: Megatron splits dim {param.partition_dim} over TP, "
                         f"the TP_DIM table says {pm.tp_dim}; update weights/name_map.py")
    if pm.tp_dim is None or size == 1:
        return None, 1, 0
    return pm.tp_dim, size, rank


def _check_shape(ckpt: HFCheckpoint, name: str, expected) -> None:
    got = ckpt.shape(name)
    if got != tuple(expected):
        raise CheckpointError(f"tensor {name} has shape {list(got)}, expected {list(expected)}")


def _read_copy(ckpt, pm, param, geo) -> torch.Tensor:
    name = pm.hf_names[None]
    dim, size, rank = tp_split(param, pm, geo)
    full = list(param.shape)
    if dim is not None:
        full[dim] *= size
    if pm.is_vocab:  # Megatron pads the vocab rows for TP; HF has exactly vocab_size rows
        full[0] = geo["vocab_size"]
        start = rank * param.shape[0]
        end = min(start + param.shape[0], geo["vocab_size"])
        _check_shape(ckpt, name, full)
        return reshape.pad_vocab(ckpt.read(name, 0, start, max(start, end)), param.shape[0])
    _check_shape(ckpt, name, full)
    if dim is None:
        return ckpt.read(name)
    start, end = reshape.shard_range(full[dim], rank, size)
    return ckpt.read(name, dim, start, end)


def _read_qkv(ckpt, pm, param, geo) -> torch.Tensor:
    _, size, rank = tp_split(param, pm, geo)
    d, groups, rest = geo["head_dim"], geo["groups"], list(param.shape[1:])
    q_per_group = geo["heads"] // groups
    g0, g1 = reshape.shard_range(groups, rank, size)
    rows = {"q": (q_per_group * d, geo["heads"] * d), "k": (d, groups * d), "v": (d, groups * d)}
    parts = []
    for part in name_map.FUSED_PARTS["qkv"]:
        per_group, total = rows[part]
        _check_shape(ckpt, pm.hf_names[part], [total, *rest])
        parts.append(ckpt.read(pm.hf_names[part], 0, g0 * per_group, g1 * per_group))
    return reshape.qkv_to_mcore(*parts, num_groups=g1 - g0, head_dim=d)


def _read_gate_up(ckpt, pm, param, geo) -> torch.Tensor:
    _, size, rank = tp_split(param, pm, geo)
    local_ffn = param.shape[0] // 2
    parts = []
    for part in name_map.FUSED_PARTS["gate_up"]:
        _check_shape(ckpt, pm.hf_names[part], [local_ffn * size, *param.shape[1:]])
        parts.append(ckpt.read(pm.hf_names[part], 0, rank * local_ffn, (rank + 1) * local_ffn))
    return reshape.gate_up_to_mcore(*parts)


_READERS = {"copy": _read_copy, "qkv": _read_qkv, "gate_up": _read_gate_up}


def check_names(ckpt: HFCheckpoint, spec) -> None:
    """The checkpoint holds exactly the tensors the architecture needs (errors name them)."""
    expected = name_map.expected_hf_shapes(spec)
    have = ckpt.keys()
    missing, extra = sorted(set(expected) - have), sorted(have - set(expected))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"tensor {missing[0]} is missing from {ckpt.dir}{more}")
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"unexpected tensor {extra[0]} in {ckpt.dir}{more}; "
                              f"not part of a {spec.model_type} model")


def check_shapes(ckpt: HFCheckpoint, spec) -> None:
    fused = name_map.fused_experts(spec)
    for name, shape in sorted(name_map.expected_hf_shapes(spec).items()):
        if name in fused:
            fused_layout(ckpt, name, spec.num_experts, fused[name][1])
        else:
            _check_shape(ckpt, name, shape)


def fused_layout(ckpt: HFCheckpoint, name: str, num_experts: int, rows_cols: tuple[int, int]) -> str:
    """The layout of a fused expert tensor (`reshape.FUSED_LAYOUTS`); a shape that is neither
    is an error naming it."""
    rows, cols = rows_cols
    got = ckpt.shape(name)
    layout = reshape.fused_experts_layout(got, num_experts, rows, cols)
    if layout is None:
        raise CheckpointError(f"tensor {name} has shape {list(got)}, expected {[num_experts, cols, rows]} "
                              f"(or transformers' {[num_experts, rows, cols]})")
    return layout


class UnstackedExperts:
    """An HFCheckpoint whose fused expert tensors (`Arch.fused_experts`) read as the
    per-expert tensors the name tables use, in either layout; other tensors read through."""

    def __init__(self, ckpt: HFCheckpoint, spec):
        self.ckpt, self.dir, self.num_experts = ckpt, ckpt.dir, spec.num_experts
        self.fused = name_map.fused_experts(spec)
        self.parts = {}  # per-expert name -> (fused name, expert, number of parts, part)
        for fused, (names, _) in self.fused.items():
            n = len(names) // spec.num_experts
            self.parts.update((name, (fused, i // n, n, i % n)) for i, name in enumerate(names))
        self._layouts: dict[str, str] = {}
        self._last = (None, None)  # ((fused, expert), its slice): gate and up are read in a row

    def _layout(self, fused: str) -> str:
        if fused not in self._layouts:
            self._layouts[fused] = fused_layout(self.ckpt, fused, self.num_experts, self.fused[fused][1])
        return self._layouts[fused]

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.parts:
            return self.ckpt.shape(name)
        fused, _, n, _ = self.parts[name]
        self._layout(fused)
        rows, cols = self.fused[fused][1]
        return rows // n, cols

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        if name not in self.parts:
            return self.ckpt.read(name, dim, start, end)
        fused, expert, n, part = self.parts[name]
        if self._last[0] != (fused, expert):
            self._last = ((fused, expert), self.ckpt.read(fused, 0, expert, expert + 1)[0])
        t = reshape.expert_part(self._last[1], self._layout(fused), n, part)
        if dim is not None:
            t = t.narrow(dim, start, (t.shape[dim] if end is None else end) - start)
        return t.contiguous()


def check_hf_checkpoint(hf_dir: str, spec) -> None:
    """Cheap up-front validation (headers only): every file readable, exactly the right names."""
    ckpt = HFCheckpoint(hf_dir)
    try:
        for file in sorted(set(ckpt.weight_map.values())):
            if not os.path.exists(os.path.join(hf_dir, file)):
                raise CheckpointError(f"safetensors file {file} listed in the index is missing from {hf_dir}")
            ckpt.open_file(file)
        check_names(ckpt, spec)
        check_shapes(ckpt, spec)
    finally:
        ckpt.close()


def _load_local(model_chunks, hf_dir: str, progress: bool, adopt: bool) -> None:
    ckpt = HFCheckpoint(hf_dir)
    try:
        load_from(ckpt, model_chunks, progress=progress, adopt=adopt)
    finally:
        ckpt.close()


def load_from(ckpt, model_chunks, progress: bool = False, adopt: bool = False) -> None:
    """This rank's chunks from `ckpt` (anything with HFCheckpoint's dir, keys, shape and read:
    plan/coverage.py passes the shipped tensor list of a 30B model, read as meta tensors)."""
    from tqdm import tqdm
    show = progress and (not dist.is_initialized() or dist.get_rank() == 0)
    spec = unwrap(model_chunks[0]).spec
    check_names(ckpt, spec)
    source = UnstackedExperts(ckpt, spec) if spec.arch.fused_experts else ckpt
    for chunk in model_chunks:
        geo = chunk_geometry(chunk)
        maps = list(param_maps(chunk, geo))
        for pm, param in tqdm(maps, desc="load", unit="param", disable=not show, file=console()):
            tensor = _READERS[pm.kind](source, pm, param, geo)
            if tensor.shape != param.shape:
                raise CheckpointError(f"{pm.mcore_name}: built {list(tensor.shape)} from "
                                      f"{list(pm.hf_names.values())}, model has {list(param.shape)}")
            if adopt and (tensor.dtype, tensor.device) == (param.dtype, param.device) and tensor.is_contiguous():
                param.data = tensor
            else:
                with torch.no_grad():
                    param.copy_(tensor)


def agree_on_errors(fn, *args) -> None:
    """Run fn on every rank; if any rank fails, all raise the first error (no rank left hanging)."""
    err = None
    try:
        fn(*args)
    except (CheckpointError, KeyError, ValueError) as e:
        err = f"{e.args[0] if isinstance(e, KeyError) else e}"
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if err:
            raise CheckpointError(err)
        return
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, err)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def load_hf_checkpoint(model_chunks, hf_dir: str, progress: bool = False, adopt: bool = False) -> None:
    """Load `hf_dir` (safetensors, single file or index) into this rank's chunks; a collective.

    `adopt` points each parameter at the tensor read (memory-mapped from the file, or built by a
    reshape) instead of copying into it, where dtype and device match: the conversion's model
    is only saved, and the copy into untouched parameter memory was its slowest part. Not for a
    model that trains: its parameters may be views into Megatron's contiguous buffers.

    Raises CheckpointError on every rank, naming the tensor or file, when the checkpoint is
    incomplete, has unknown tensors, a wrong shape or an unreadable file.
    """
    agree_on_errors(_load_local, model_chunks, hf_dir, progress, adopt)
