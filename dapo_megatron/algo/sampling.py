"""DAPO dynamic sampling: drop groups that carry no learning signal, regenerate until the batch is full.

A group whose n responses all score the same (all right or all wrong) has zero GRPO advantage for
every token, so it only dilutes the batch. `filter_groups` is the rule; `DynamicSampler` is the
accumulator the driver feeds one generation round at a time.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Generic, Sequence, TypeVar

import torch

ON_EXHAUSTED = ("error", "train_partial")


def filter_groups(metric_values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Keep mask [B] bool: True for members of groups whose metric values are not all identical.

    metric_values [B] (e.g. acc per response), group_index [B] int, any order. A single-member group
    is kept (nothing to compare; verl does the same).
    """
    _, inverse, counts = torch.unique(torch.as_tensor(group_index), return_inverse=True, return_counts=True)
    values = metric_values.to(torch.float64)
    group_max = values.new_full(counts.shape, float("-inf")).scatter_reduce(0, inverse, values, "amax")
    group_min = values.new_full(counts.shape, float("inf")).scatter_reduce(0, inverse, values, "amin")
    return ((group_max != group_min) | (counts == 1))[inverse]


P = TypeVar("P")


@dataclass
class Group(Generic[P]):
    """The n responses of one prompt: their filter metric values and what the driver needs back."""
    metric_values: Sequence[float]  # [n], e.g. acc of each response
    payload: P = None  # opaque to the sampler (the driver's ScoredGroup: responses, rewards, prompt)


class DynamicSampler:
    """Accumulates qualified groups over generation rounds until `train_batch_size` are kept.

    Driver loop:  while not s.should_stop(): s.add(generate_round())
                  m = s.metrics(); groups = s.take()
    take() returns exactly train_batch_size groups (surplus dropped in arrival order) and resets for
    the next step. If max_num_gen_batches (> 0; <= 0 means no limit) rounds run before the batch is
    full, on_exhausted="error" raises and "train_partial" warns and returns the groups it has (maybe
    none: the driver then skips the step). enable=False keeps every group.

    state_dict() holds the cumulative counters only. Save it between steps: a step in progress (its
    buffer and round count) is not saved and restarts from round 0 on resume.
    """

    def __init__(self, train_batch_size: int, max_num_gen_batches: int, on_exhausted: str = "train_partial",
                 enable: bool = True):
        if on_exhausted not in ON_EXHAUSTED:
            raise ValueError(f"unknown on_exhausted {on_exhausted!r}; set algorithm.filter_groups.on_exhausted "
                             f"to one of {', '.join(ON_EXHAUSTED)}")
        if train_batch_size <= 0:
            raise ValueError(f"train_batch_size must be > 0, got {train_batch_size}; set data.train_batch_size")
        self.train_batch_size = train_batch_size
        self.max_num_gen_batches = max_num_gen_batches
        self.on_exhausted = on_exhausted
        self.enable = enable
        self.totals = {"gen_batches": 0, "generated_groups": 0, "kept_groups": 0, "steps": 0}
        self._reset()

    def _reset(self) -> None:
        self.buffer: list[Group] = []
        self.num_gen_batches = 0
        self.num_generated_groups = 0

    def start_round(self) -> None:
        """Count one generation round (data.gen_batch_size prompts) against max_num_gen_batches."""
        self.num_gen_batches += 1
        self.totals["gen_batches"] += 1

    def add(self, groups: Sequence[Group], *, new_round: bool = True) -> list[Group]:
        """Add finished groups; keeps those that pass `filter_groups` (all if disabled).

        Sync mode adds a whole round at once (new_round=True counts it). Early-stop mode calls
        `start_round()` when it starts a round's prompts and adds groups as they finish
        (new_round=False), so a round's groups may arrive over many calls. Returns the kept groups.
        """
        if any(len(g.metric_values) == 0 for g in groups):
            raise ValueError("every group needs at least one metric value (one per response)")
        kept = list(groups)
        if self.enable and groups:
            sizes = torch.tensor([len(g.metric_values) for g in groups])  # [G]
            values = torch.tensor([float(v) for g in groups for v in g.metric_values])  # [sum n]
            keep = filter_groups(values, torch.repeat_interleave(torch.arange(len(groups)), sizes))
            first = torch.cumsum(sizes, 0) - sizes  # [G]: each group's first member
            kept = [g for g, k in zip(groups, keep[first].tolist()) if k]
        self.buffer.extend(kept)
        if new_round:
            self.start_round()
        self.num_generated_groups += len(groups)
        self.totals["generated_groups"] += len(groups)
        self.totals["kept_groups"] += len(kept)
        return kept

    @property
    def is_full(self) -> bool:
        return len(self.buffer) >= self.train_batch_size

    @property
    def exhausted(self) -> bool:
        return 0 < self.max_num_gen_batches <= self.num_gen_batches

    def should_stop(self) -> bool:
        """True when the batch is full or the round budget is spent: stop generating, call take()."""
        return self.is_full or self.exhausted

    def groups_to_fill(self, batches_after: int = 0) -> float:
        """How many more groups must finish to fill the batch (and `batches_after` more batches),
        at the keep rate seen so far over all steps (1 before any group; inf while nothing was ever
        kept). Early-stop collection keeps no more than this in flight, so fewer responses are
        aborted once the batch is full."""
        missing = max(self.train_batch_size - len(self.buffer), 0)
        generated, kept = self.totals["generated_groups"], self.totals["kept_groups"]
        if not missing:
            return 0
        missing += batches_after * self.train_batch_size
        if generated and not kept:
            return math.inf
        return math.ceil(missing * generated / kept) if generated else missing

    def take(self) -> list[Group]:
        """The step's groups, in arrival order; resets the buffer and round count."""
        if not self.is_full:
            if not self.exhausted:
                raise RuntimeError("take() before should_stop(): keep calling add() until it is True")
            message = (f"dynamic sampling kept {len(self.buffer)} of {self.train_batch_size} groups after "
                       f"{self.num_gen_batches} generation rounds (algorithm.filter_groups.max_num_gen_batches="
                       f"{self.max_num_gen_batches}); raise max_num_gen_batches, or set "
                       "algorithm.filter_groups.on_exhausted=train_partial to train on fewer groups")
            if self.on_exhausted == "error":
                raise RuntimeError(message)
            warnings.warn(message + " (training on the partial batch)", RuntimeWarning, stacklevel=2)
        groups = self.buffer[: self.train_batch_size]
        self.totals["steps"] += 1
        self._reset()
        return groups

    def metrics(self) -> dict[str, int]:
        """Counters of the step in progress; read them before take() resets them."""
        return {"dynamic_sampling/num_gen_batches": self.num_gen_batches,
                "dynamic_sampling/generated_groups": self.num_generated_groups,
                "dynamic_sampling/kept_groups": len(self.buffer)}

    def state_dict(self) -> dict[str, int]:
        return dict(self.totals)

    def load_state_dict(self, state: dict[str, int]) -> None:
        missing = set(self.totals) - set(state)
        if missing:
            raise KeyError(f"dynamic sampler state lacks {sorted(missing)}")
        self.totals = {k: int(state[k]) for k in self.totals}
