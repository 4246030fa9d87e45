"""Training state per rank, exactly: the parameters, main grads and optimizer state Megatron-Core
allocates for a model at a layout, counted from the weight tables without building anything.

The tensors come from the weight tables (HF -> Megatron names: `Arch.names`; HF shape, TP dim:
`weights/name_map`); this file says how Megatron lays them out on a rank: PP stages own whole
layers, EP ranks whole experts, TP / expert-TP ranks a slice of the split dim, the vocab padded
to a multiple of 128 x TP. DDP packs each chunk's trainable parameters into flat buffers, dense
and expert separately, walking them in reverse registration order; with the distributed optimizer
every parameter starts at a multiple of 64 elements, each bucket ends at a multiple of
lcm(DP, 128), a tied embedding split over PP gets a bucket of its own, and each bucket is sharded
evenly over the buffer's DP group (megatron/core/distributed/param_and_grad_buffer.py, 0.16). The
optimizer then holds, for each parameter range in its shard, Adam's two fp32 moments, a fp32
master copy when the parameter is 16-bit, and torch Adam's fp32 `step` scalar.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dapo_megatron.models.gpt import padded_vocab_size
from dapo_megatron.weights import name_map as nm

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GRAD_BYTES = 4  # DDP main grads: grad_reduce_in_fp32 (train/optim.py)
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4  # fp32 master copy of a 16-bit parameter
STEP_BYTES = 4  # torch Adam's per-parameter `step` scalar

# Megatron registration order of one decoder layer's parameters (local spec), by template suffix.
_LAYER_ORDER = ("input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight",
                "self_attention.linear_qkv.bias", "self_attention.q_layernorm.weight",
                "self_attention.k_layernorm.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight",
                "mlp.linear_fc2.weight", "mlp.router.weight", "mlp.experts.local_experts.{}.linear_fc1.weight",
                "mlp.experts.local_experts.{}.linear_fc2.weight")


@dataclass(frozen=True)
class Layout:
    """The actor's parallel layout over `world` ranks (config: actor.parallel, the actor's devices)."""
    world: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1

    @classmethod
    def of(cls, parallel, world: int) -> "Layout":
        """From a ParallelConfig (actor.parallel, ref.parallel) over `world` ranks."""
        return cls(world, parallel.tp, parallel.pp, parallel.vpp, parallel.ep, parallel.etp, parallel.cp)

    @property
    def dp(self) -> int:  # the dense parameters' data-parallel group (with CP folded in)
        return self.world // (self.tp * self.pp)

    @property
    def edp(self) -> int:  # the experts' data-parallel group
        return self.world // (self.etp * self.ep * self.pp)


@dataclass(frozen=True)
class Tensor:
    name: str  # Megatron template (`decoder.layers.{}...`), one row per (layer, expert) instance
    numel: int  # on this rank
    expert: bool  # lives in the expert buffer (EP > 1)
    shared_embedding: bool = False


def _mcore_shapes(spec) -> dict[str, tuple[str, int]]:
    """{Megatron template: (how it is split, full numel)}; fused q/k/v and gate/up summed."""
    dims, shapes, out = spec.dims, nm.hf_shapes(spec.model_type), {}
    for hf, target in spec.arch.names.items():
        mcore = target[0] if isinstance(target, tuple) else target
        numel = math.prod(dims[d] for d in shapes[hf])
        out[mcore] = out.get(mcore, 0) + numel
    return out


def _local(template: str, numel: int, spec, lay: Layout) -> int:
    """Elements of one instance of `template` on one rank."""
    if template in nm.VOCAB_PARAMS:
        return padded_vocab_size(spec.vocab_size, lay.tp) // lay.tp * spec.hidden_size
    if nm.TP_DIM.get(template) is None:
        return numel
    return numel // (lay.etp if ".local_experts." in template else lay.tp)


def chunk_tensors(spec, lay: Layout, stage: int, vp_stage: int = 0) -> list[Tensor]:
    """The trainable tensors of one model chunk (PP `stage`, virtual stage `vp_stage`), in
    Megatron's registration order."""
    shapes = _mcore_shapes(spec)
    chunks = lay.pp * lay.vpp
    per_chunk = spec.num_layers // chunks
    first = vp_stage == 0 and stage == 0
    last = vp_stage == lay.vpp - 1 and stage == lay.pp - 1
    ep_split = lay.ep > 1
    local_experts = spec.num_experts // lay.ep if spec.num_experts else 0
    shared = spec.tie_word_embeddings and lay.pp > 1

    def one(template: str, expert: bool = False, **kw) -> Tensor:
        return Tensor(template, _local(template, shapes[template], spec, lay), expert and ep_split, **kw)

    out = []
    if first:
        out.append(one("embedding.word_embeddings.weight", shared_embedding=shared))
    for _layer in range(per_chunk):
        for suffix in _LAYER_ORDER:
            template = "decoder.layers.{}." + suffix
            if template not in shapes:
                continue
            if ".local_experts." in template:
                continue  # below, expert by expert
            out.append(one(template))
            if suffix == "mlp.router.weight":
                for _e in range(local_experts):
                    out += [one(t, expert=True) for t in (
                        "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.weight",
                        "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight")]
    if last:
        out.append(one("decoder.final_layernorm.weight"))
        if not spec.tie_word_embeddings or lay.pp > 1:
            out.append(one("output_layer.weight", shared_embedding=shared))
    if first and spec.arch.verbatim:  # the vision tower, replicated, registered last
        out += [Tensor(name, math.prod(shape), False) for name, shape in nm.vision_tower_shapes(spec).items()]
    return out


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def buffer_layout(tensors: list[Tensor], dp: int, distributed: bool) -> tuple[int, list[tuple[int, int]], list]:
    """One DDP buffer: (its numel, its buckets as (start, end), each tensor's (start, end, bucket))."""
    start = bucket_start = 0
    buckets, where, open_bucket = [], [], False

    def close(end: int) -> int:
        nonlocal bucket_start, open_bucket
        end = _pad(end, math.lcm(dp, 128)) if distributed else end
        buckets.append((bucket_start, end))
        bucket_start, open_bucket = end, False
        return end

    for t in reversed(tensors):
        if distributed:
            start = _pad(start, 64)
        own = t.shared_embedding and distributed
        if own and open_bucket:
            start = close(start)
        where.append((start, start + t.numel, len(buckets)))
        open_bucket, start = True, start + t.numel
        if own:
            start = close(start)
    if open_bucket:
        close(start)
    return (buckets[-1][1] if buckets else 0), buckets, where


@dataclass(frozen=True)
class RankState:
    """Bytes one actor rank holds between steps."""
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def rank_state(spec, lay: Layout, *, dtype: str, distributed_optimizer: bool, stage: int = 0,
               dp_rank: int = 0, edp_rank: int = 0) -> RankState:
    """The state of the rank at pipeline `stage`, data-parallel rank `dp_rank` of the dense
    buffers and `edp_rank` of the expert ones. Every DP rank holds the same parameters and grads;
    the distributed optimizer's share differs by a few padding elements between them."""
    pbytes = DTYPE_BYTES[dtype]
    per_opt = ADAM_BYTES + (MASTER_BYTES if pbytes < 4 else 0)
    params = grads = optimizer = 0
    for vp in range(lay.vpp):
        tensors = chunk_tensors(spec, lay, stage, vp)
        for expert, group, rank in ((False, lay.dp, dp_rank), (True, lay.edp, edp_rank)):
            ts = [t for t in tensors if t.expert == expert]
            if not ts:
                continue
            numel, buckets, where = buffer_layout(ts, group, distributed_optimizer)
            grads += numel * GRAD_BYTES
            if not distributed_optimizer:
                params += sum(t.numel for t in ts) * pbytes
                optimizer += sum(t.numel * per_opt + STEP_BYTES for t in ts)
                continue
            params += numel * pbytes  # the params are views of DDP's padded param buffer
            for begin, end, b in where:
                lo, hi = buckets[b]
                size = (hi - lo) // group
                shard = (lo + rank * size, lo + (rank + 1) * size)
                mine = min(end, shard[1]) - max(begin, shard[0])
                if mine > 0:
                    optimizer += mine * per_opt + STEP_BYTES
    return RankState(params, grads, optimizer)


def worst_rank_state(spec, lay: Layout, *, dtype: str, distributed_optimizer: bool) -> tuple[RankState, int]:
    """The largest rank state over pipeline stages (and DP ranks), with its stage."""
    # The shards' padding lands on the last DP rank of a bucket, so the first and last are the extremes.
    ranks = [(d, e) for d in {0, lay.dp - 1} for e in {0, lay.edp - 1}] if distributed_optimizer else [(0, 0)]
    return max(((rank_state(spec, lay, dtype=dtype, distributed_optimizer=distributed_optimizer, stage=stage,
                            dp_rank=d, edp_rank=e), stage) for stage in range(lay.pp) for d, e in ranks),
               key=lambda pair: pair[0].total)


def reference_params(spec, lay: Layout, *, dtype: str, stage: int = 0) -> int:
    """The reference model's weights on one rank: the same tensors, frozen (no DDP buffers)."""
    return sum(t.numel for vp in range(lay.vpp) for t in chunk_tensors(spec, lay, stage, vp)) * DTYPE_BYTES[dtype]
