"""Routing replay for MoE actors: the routers take their top-k experts from the batch.

`actor.router_replay`:
    off       every forward pass routes by the current router weights.
    actor     (R2) the old-log-prob pass records each token's experts into `routed_experts`; the
              update replays them, so every PPO ratio compares the same sub-network.
    rollout   (R3) the engines return the experts they chose for every prompt and response token;
              the old-log-prob pass and the update replay them, so the actor scores the sub-network
              that sampled. The old-log-prob pass also measures `rollout/router_agreement`: the
              share of token x layer top-k sets the actor would have chosen itself.

`routed_experts` is a position field ([P + R, layers, top_k] per sample, int16, -1 where unknown:
the last token, padding). A row of -1 routes by the router, which only touches positions whose
outputs nothing reads. The reference model never replays (it has no slots).

Megatron's TopKRouter calls `router_replay.get_replay_topk(...)` when that attribute is set; we
install our own `RouterSlot` there per router (not megatron's `RouterReplay`, whose process-global
list mixes the actor's and the reference's routers). Each forward call of a chunk takes the next
target off its slots' queues (`feed` puts one micro-batch's targets there). Under full activation
recompute the first pass runs without grad and the recompute with grad, so a slot hands its
recompute the very indices its forward used, whatever the schedule's order.
"""
from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from dapo_megatron.parallel import coords, group

PAD = -1  # unknown route: the router chooses


class RouterSlot:
    """One MoE layer's router replay state on this rank (duck-types megatron's RouterReplay)."""

    def __init__(self, layer: int, sequence_parallel: bool):
        self.layer = layer  # index among the model's MoE layers (all layers are MoE in our models)
        self.sequence_parallel = sequence_parallel
        self.targets: deque = deque()  # per forward call: [tokens, k] long, PAD rows, or None
        self.recompute: deque = deque()  # what each forward used, for its recompute
        self.recorded: list[torch.Tensor] = []  # per forward call: [tokens, k] the router's choice
        self.record = self.expect_recompute = False
        self.agree = self.total = 0  # token x layer sets equal / compared (targets vs own choice)

    def reset(self) -> None:
        self.targets.clear()
        self.recompute.clear()
        self.recorded = []
        self.agree = self.total = 0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.expect_recompute and torch.is_grad_enabled():  # the recompute of a checkpointed layer
            used = self.recompute.popleft()
            return scores.gather(1, used), used
        target = self.targets.popleft() if self.targets else None
        probs, used = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if target is not None:
            target = target.to(used.device)
            known = target[:, 0] >= 0  # [tokens]
            wanted = target.sort(dim=1).values
            _check_targets(wanted, known, scores.shape[1], self.layer)
            same = (used.sort(dim=1).values == wanted).all(dim=1)
            self.agree += int((same & known).sum())
            self.total += int(known.sum())
            used = torch.where(known[:, None], target, used)
            probs = scores.gather(1, used)
        if self.record:  # what this pass routed by: its own choice, or the replayed targets
            self.recorded.append(used.detach())
        if self.expect_recompute:
            self.recompute.append(used.detach())
        return probs, used


def _check_targets(wanted: torch.Tensor, known: torch.Tensor, experts: int, layer: int) -> None:
    """Sorted target sets [tokens, k] must name k distinct experts below `experts`. Engines have
    returned all-zero routes (FlashInfer MoE kernels, vllm-ascend on A3): replaying them would
    send every token to expert 0 and train on it silently."""
    bad = known & ((wanted[:, 1:] == wanted[:, :-1]).any(dim=1) | (wanted[:, -1] >= experts))
    if bool(bad.any()):
        raise ValueError(f"routed_experts of MoE layer {layer}: {int(bad.sum())} of {int(known.sum())} tokens name an "
                         f"expert twice or one >= {experts} (all-zero routes are a known engine bug); set "
                         f"actor.router_replay=actor or off")


@dataclass
class Routes:
    """A model's router slots and the shape of its routes. `record`: the old-log-prob pass
    records the routes it used (mode actor); `recompute`: the update recomputes whole layers
    (actor.recompute_granularity=full)."""
    flat: list[RouterSlot]
    num_layers: int
    top_k: int
    record: bool = False
    recompute: bool = False


def install(chunks: list, num_layers: int, top_k: int, *, record: bool = False, recompute: bool = False) -> Routes:
    """Put a RouterSlot on every TopKRouter of this rank's chunks."""
    from megatron.core.transformer.moe.router import TopKRouter
    flat = []
    for chunk in chunks:
        slots = []
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                module.router_replay = RouterSlot(module.layer_number - 1, module.config.sequence_parallel)
                slots.append(module.router_replay)
        chunk._router_slots = slots  # read by `feed` through whatever wraps the chunk
        flat += slots
    return Routes(flat, num_layers, top_k, record, recompute)


def slots_of(model) -> list[RouterSlot]:
    """The slots of a chunk, or of the chunk that wrappers (DDP, Float16Module) hold; [] for a
    model without them."""
    while model is not None and not hasattr(model, "_router_slots"):
        model = getattr(model, "module", None)
    return [] if model is None else model._router_slots


def _local_rows(routes: torch.Tensor, slot: RouterSlot) -> torch.Tensor:
    """[b, S, k] of one layer -> the router's token order on this rank: [S_local * b, k], where the
    router flattens hidden states [S, b, H] sequence-major and SP gives each TP rank a slice of S."""
    rows = routes.transpose(0, 1)  # [S, b, k]
    if slot.sequence_parallel:
        c = coords()
        part = rows.shape[0] // c.tp
        rows = rows[c.tp_rank * part:(c.tp_rank + 1) * part]
    return rows.reshape(-1, rows.shape[-1]).long()


def feed(model, micro) -> None:
    """Queue `micro.routed_experts` ([b, S, layers, k]) for the next forward call of `model`."""
    routes = micro.routed_experts
    for slot in slots_of(model):
        slot.targets.append(None if routes is None else _local_rows(routes[:, :, slot.layer], slot))


@contextlib.contextmanager
def routing_mode(routes: Optional[Routes], *, update: bool):
    """Set every slot for one schedule run: an old-log-prob pass records (`routes.record`), an
    update's recompute replays what its forward used (`routes.recompute`). Targets, when a
    micro-batch has them, are always replayed. Queues start empty and are emptied after; a no-op
    without routes (dense models, replay off)."""
    flat = routes.flat if routes is not None else []
    for s in flat:
        s.reset()
        s.record, s.expect_recompute = routes.record and not update, routes.recompute and update
    try:
        yield
    finally:
        for s in flat:
            s.targets.clear()
            s.recompute.clear()
            s.record = s.expect_recompute = False


def agreement(slots: list[RouterSlot]) -> Optional[float]:
    """Share of (token, layer) top-k sets where the targets equal the router's own choice, over
    the whole world (a collective); None when no target was compared."""
    counts = torch.tensor([sum(s.agree for s in slots), sum(s.total for s in slots)], dtype=torch.float64)
    dist.all_reduce(counts)
    return None if counts[1] == 0 else float(counts[0] / counts[1])


def gather_recorded(slots: list[RouterSlot], micros: list, num_layers: int, top_k: int,
                    width: int) -> list[torch.Tensor]:
    """Per micro-batch [b, width, layers, k] int16 of the routes recorded in one forward pass,
    complete on every rank of a TP x PP group (each holds its layers and its SP slice); PAD where
    no router ran (padding columns)."""
    c = coords()
    out = []
    for m, micro in enumerate(micros):
        b = micro.tokens.shape[0]
        # int32: gloo reduces no int16
        full = torch.full((b, width, num_layers, top_k), PAD, dtype=torch.int32)
        for slot in slots:
            rows = slot.recorded[m].cpu().view(-1, b, top_k).transpose(0, 1)  # [b, S_local, k]
            start = c.tp_rank * rows.shape[1] if slot.sequence_parallel else 0
            rows = rows[:, :max(width - start, 0)]  # columns past the batch's longest: padding
            full[:, start:start + rows.shape[1], slot.layer] = rows.to(torch.int32)
        for name, size in (("tp", c.tp), ("pp", c.pp)):
            if size > 1:  # PAD (-1) < every expert id: MAX merges the ranks' pieces
                dist.all_reduce(full, op=dist.ReduceOp.MAX, group=group(name))
        out.append(full.to(torch.int16))
    return out
