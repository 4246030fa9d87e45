"""The actor's real shape, built: every distinct rank of a config's actor built by Megatron-Core
on the meta device, its state set against the plan's (plan/state.py) byte for byte.

    python -m dapo_megatron.plan --config-name qwen3_30b_a3b_megatron_npu --build

One process plays every rank in turn: torch's fake process group gives the world size and the
rank, Megatron's parallel state is initialised over it (train/parallel.fake_rank), and our own
build_model, wrap_ddp and build_optimizer run with every tensor on the meta device (no memory,
no device). A rank is
distinct by its (pipeline stage, TP rank, EP rank, expert-TP rank); its data-parallel copies
hold the same parameters and grads. What is counted, from the built objects:
  params     DDP's param buffers (the parameters are views of them), else the parameters
  grads      DDP's grad buffers
  optimizer  per main parameter of the optimizer's shard: its fp32 master when Megatron made
             one, Adam's two fp32 moments (torch creates them at the first step: the shard's
             numel) and Adam's fp32 `step`
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from dapo_megatron.config import role_devices
from dapo_megatron.device import get_device
from dapo_megatron.dtypes import DTYPES
from dapo_megatron.models import build_model
from dapo_megatron.parallel import Coords
from dapo_megatron.plan.state import ADAM_BYTES, STEP_BYTES, Layout, RankState, rank_state
from dapo_megatron.train.actor import recompute_overrides
from dapo_megatron.train.optim import build_optimizer, wrap_ddp
from dapo_megatron.train.parallel import fake_rank
from dapo_megatron.weights.sync import sender_roles


@dataclass(frozen=True)
class RankBuild:
    rank: int
    coords: Coords
    built: RankState
    planned: RankState
    seconds: float

    @property
    def equal(self) -> bool:
        return self.built == self.planned


def _optimizer_bytes(optimizer) -> int:
    """Masters, moments and steps of the optimizer's main parameters (its shard)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    total = 0
    for opt in parts:
        masters = {id(m) for groups in (getattr(opt, "shard_fp32_from_float16_groups", None)
                                        or getattr(opt, "fp32_from_float16_groups", None) or [])
                   for m in groups}
        for group in opt.optimizer.param_groups:
            for main in group["params"]:
                n = main.numel()
                total += n * ADAM_BYTES + STEP_BYTES + (n * main.element_size() if id(main) in masters else 0)
    return total


def _state_of(model, optimizer) -> tuple[int, int, int]:
    buffers = [b for chunk in model for b in chunk.buffers + chunk.expert_parallel_buffers]
    if all(b.param_data is not None for b in buffers):
        params = sum(b.param_data.numel() * b.param_data.element_size() for b in buffers)
    else:
        params = sum(p.numel() * p.element_size() for chunk in model for p in chunk.parameters())
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    return params, grads, _optimizer_bytes(optimizer)


def build_ranks(cfg, spec, *, world: int | None = None, ranks=None, on_rank=None,
                coverage=None) -> list[RankBuild]:
    """Every distinct rank of `cfg`'s actor over `world` devices (default: the actor's devices),
    or of the global `ranks` given, built and set against the plan. `on_rank(RankBuild)` hears
    of each as it is done; a `coverage.Coverage` given loads and exports each (plan/coverage.py)."""
    a, p = cfg.actor, cfg.actor.parallel
    world = world or role_devices(cfg)["actor"]
    device = get_device("cpu")  # the CPU backend's patches put Megatron's device tensors on meta
    device.setup_megatron()
    layout = Layout.of(p, world)
    seen, out = set(), []
    for rank in range(world) if ranks is None else ranks:
        start = time.perf_counter()
        with fake_rank(p, rank, world) as c:
            if coverage is not None:
                coverage.roles(c, *sender_roles())
            key = (c.pp_rank, c.tp_rank, c.ep_rank, c.etp_rank)
            if key in seen:  # a data-parallel copy of a rank built already
                continue
            seen.add(key)
            with device.meta_build():
                with torch.device("meta"):
                    # no weight init: meta tensors hold no values, and torch's normal_ on meta runs
                    # through Python decompositions (22 of 38 s for a 16-rank config)
                    chunks = build_model(spec, dtype=cfg.model.dtype, sequence_parallel=p.sequence_parallel,
                                         device=device, perform_initialization=False,
                                         **recompute_overrides(a.recompute_granularity))
                    model = wrap_ddp(chunks, use_distributed_optimizer=a.optim.use_distributed_optimizer)
                # outside torch.device("meta"): the optimizer's set-up gathers Python objects on the host.
                # The whole optimizer state, wherever it lives: with actor.optim.cpu_offload the plan
                # puts its share on the host, and the hybrid optimizer cannot step meta tensors.
                optim = dataclasses.replace(a.optim, cpu_offload=False)
                optimizer = build_optimizer(model, optim, DTYPES[cfg.model.dtype].torch)
            built = RankState(*_state_of(model, optimizer))
            if coverage is not None:
                coverage.add(rank, c, model)
        planned = rank_state(spec, layout, dtype=cfg.model.dtype, distributed_optimizer=a.optim.use_distributed_optimizer,
                             stage=c.pp_rank, dp_rank=c.dp_rank, edp_rank=c.edp_rank)
        out.append(RankBuild(rank, c, built, planned, time.perf_counter() - start))
        if on_rank:
            on_rank(out[-1])
    return out


def render_row(b: RankBuild) -> str:
    c = b.coords
    where = f"rank {b.rank:>3} (pp {c.pp_rank} tp {c.tp_rank} ep {c.ep_rank} etp {c.etp_rank} dp {c.dp_rank} " \
            f"edp {c.edp_rank})"
    parts = []
    for name in ("params", "grads", "optimizer"):
        got, want = getattr(b.built, name), getattr(b.planned, name)
        parts.append(f"{name} {got:,}" + ("" if got == want else f" != plan {want:,}"))
    return f"{where}: {', '.join(parts)}: {'equal' if b.equal else 'DIFFERENT'} ({b.seconds:.1f} s)"
