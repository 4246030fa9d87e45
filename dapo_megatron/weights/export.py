"""Export sharded Megatron model chunks as full HF tensors, in buckets: the weight-sync source.

`export_hf` is a generator and a collective: every rank of the model must iterate it to the
end, in step, because tensors are gathered over TP (and experts over expert-TP / EP) on the way.

Which rank yields what:
- every rank yields the tensors of its own pipeline stage (all of its VPP chunks), with global
  layer ids; the embedding on the first stage, final norm and lm_head on the last;
- non-expert tensors are all-gathered over TP, so every TP rank (and DP replica) yields the same
  full tensors;
- experts="gather": experts are gathered over expert-TP and EP, every rank yields all experts of
  its stage; experts="owner": gathered over expert-TP only, each EP rank yields just its own
  experts (with global ids), for transports that route each expert to its rollout owner.
Tensors stay on the parameters' device and dtype; vocab padding is trimmed; a tied lm_head is
not yielded (HF ties it to embed_tokens). A model whose files fuse each layer's experts
(`Arch.fused_experts`, Qwen3-VL-MoE) yields them fused, in the official layout, with
experts="gather" (once the layer's last expert is gathered), per expert with "owner".
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from dapo_megatron.parallel import coords, group
from dapo_megatron.weights import name_map, reshape
from dapo_megatron.weights.hf_io import ShardWriter
from dapo_megatron.weights.load import chunk_geometry, param_maps, tp_split, unwrap


def _all_gather(tensor: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def _to_hf(pm, shards: list[torch.Tensor], dim, geo) -> dict[str, torch.Tensor]:
    """TP shards of one Megatron parameter -> {hf_name: full HF tensor}."""
    if pm.kind == "copy":
        full = shards[0] if dim is None else torch.cat(shards, dim=dim)
        if pm.is_vocab:
            full = reshape.trim_vocab(full, geo["vocab_size"])
        return {pm.hf_names[None]: full}
    if pm.kind == "qkv":
        local_groups = geo["groups"] // len(shards)
        per_shard = [reshape.qkv_from_mcore(s, local_groups, geo["head_dim"]) for s in shards]
    else:
        per_shard = [reshape.gate_up_from_mcore(s) for s in shards]
    # q, k, v or gate, up; without TP a part is a view of the parameter, written without a copy
    parts = [p[0] if len(p) == 1 else torch.cat(p, dim=0) for p in zip(*per_shard)]
    names = ("q", "k", "v") if pm.kind == "qkv" else ("gate", "up")
    return {pm.hf_names[n]: t for n, t in zip(names, parts)}


def _groups():
    return {name: group(name) for name in ("tp", "etp", "ep")}


def _expert_over_ep(pm, tensors: dict, geo, group) -> dict[str, torch.Tensor]:
    """One local expert's HF tensors -> the same expert slot of every EP rank, with global ids."""
    out = {}
    for name, t in tensors.items():
        gathered = _all_gather(t, group, geo["ep"])
        for ep_rank, g in enumerate(gathered):
            out[_rename_expert(name, pm, geo, ep_rank)] = g
    return out


def _rename_expert(hf_name: str, pm, geo, ep_rank: int) -> str:
    """The HF name of the same local expert slot on another EP rank."""
    _, _, local = name_map.split_ids(pm.mcore_name)
    mine = reshape.global_expert_id(local, geo["ep_rank"], geo["experts_per_rank"])
    theirs = reshape.global_expert_id(local, ep_rank, geo["experts_per_rank"])
    return hf_name.replace(f".experts.{mine}.", f".experts.{theirs}.", 1)


class _ExpertStacker:
    """Holds gathered per-expert tensors until a fused file tensor has all of them, then stacks."""

    def __init__(self, spec):
        self.fused = name_map.fused_experts(spec)
        self.into = {name: fused for fused, (names, _) in self.fused.items() for name in names}
        self.parts = {fused: len(names) // spec.num_experts for fused, (names, _) in self.fused.items()}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in tensors.items():
            fused = self.into.get(name)
            if fused is None:
                out[name] = t
                continue
            got = self.pending.setdefault(fused, {})
            got[name] = t
            names = self.fused[fused][0]
            if len(got) == len(names):
                out[fused] = reshape.stack_experts([got[n] for n in names], self.parts[fused])
                del self.pending[fused]
        return out

    def check_done(self) -> None:
        if self.pending:
            fused, got = next(iter(self.pending.items()))
            raise RuntimeError(f"export: {fused} got {len(got)} of its {len(self.fused[fused][0])} expert tensors")


def iter_hf_params(model_chunks, experts: str = "gather") -> Iterator[tuple[object, dict[str, torch.Tensor]]]:
    """(ParamMap, {hf_name: full tensor}) per Megatron parameter; see the module docstring. The
    dict is empty for an expert whose fused tensor is still incomplete."""
    if experts not in ("gather", "owner"):
        raise ValueError(f"experts must be 'gather' or 'owner', got {experts!r}")
    groups = _groups()
    spec = unwrap(model_chunks[0]).spec
    stacker = _ExpertStacker(spec) if experts == "gather" and spec.arch.fused_experts else None
    for chunk in model_chunks:
        geo = chunk_geometry(chunk)
        for pm, param in param_maps(chunk, geo):
            if geo["tied"] and pm.mcore_name == "output_layer.weight":
                continue  # the last stage's copy of the tied embedding
            dim, size, _ = tp_split(param, pm, geo)
            shards = _all_gather(param.data, groups["etp" if pm.is_expert else "tp"], size)
            tensors = _to_hf(pm, shards, dim, geo)
            if pm.is_expert and experts == "gather":
                tensors = _expert_over_ep(pm, tensors, geo, groups["ep"])
                if stacker is not None:
                    tensors = stacker.add(tensors)
            yield pm, tensors
    if stacker is not None:
        stacker.check_done()


def iter_hf_tensors(model_chunks, experts: str = "gather") -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) one at a time; see the module docstring for who yields what."""
    for _, tensors in iter_hf_params(model_chunks, experts):
        yield from tensors.items()


def bucketize(items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of about `bucket_bytes` (a tensor is never split)."""
    bucket, size = [], 0
    for name, tensor in items:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def export_hf(model_chunks, bucket_bytes: int = 1 << 30,
              experts: str = "gather") -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets (lists) of (hf_name, full tensor) of about `bucket_bytes` each; a collective."""
    yield from bucketize(iter_hf_tensors(model_chunks, experts), bucket_bytes)


def is_dense_owner() -> bool:
    """True on the one rank per pipeline stage (TP rank 0 of DP / CP replica 0) that writes or
    sends the stage's non-expert tensors; the others hold identical copies after the TP gather."""
    c = coords()
    return c.tp_rank == 0 and c.dp_rank == 0 and c.cp_rank == 0


def write_hf_shards(model_chunks, out_dir: str, shard_bytes: int, on_tensor=None) -> dict:
    """Export into HF safetensors shards in `out_dir`, one writer per pipeline stage (TP rank 0
    of DP / CP replica 0); a collective. Returns {"weight_map", "total_bytes"} on writers, {}
    elsewhere: the caller merges them and calls `hf_io.finalize_shards`. Tensor by tensor, not in
    buckets: the writer puts each in its file at once, so a reshaped copy (QKV, gate/up) lives only
    until the next one and peak memory stays the stage's weights plus one tensor."""
    writer = is_dense_owner()
    shards = ShardWriter(out_dir, f"part-s{coords().pp_rank}", shard_bytes)
    for name, tensor in iter_hf_tensors(model_chunks):
        if writer:
            shards.add(name, tensor)
        if on_tensor is not None:
            on_tensor(name)
    shards.flush()
    return {"weight_map": shards.weight_map, "total_bytes": shards.total_bytes} if writer else {}
