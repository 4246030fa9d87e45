"""What every collection strategy shares: the groups it keeps and their metrics (`Collected`),
where their rows go (`Store`), what it draws from (`Source`), the token accounting of one
collection (`Tokens`, `finish`), and the kept groups as the step's `StepBatch`."""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import torch

from dapo_megatron.algo import DynamicSampler, Group
from dapo_megatron.data.dataset import PromptDataset, PromptItem
from dapo_megatron.data.sampler import PromptSampler
from dapo_megatron.dataplane import DataPlane, StepBatch
from dapo_megatron.rollout.health import EngineHealth
from dapo_megatron.rollout.types import Sampling, StoredGroup, request_of


@dataclass
class ScoredGroup:
    """What a group carries from scoring to the batch: its prompt, its n responses' keys and
    lengths, their rewards."""
    item: PromptItem
    rollout: StoredGroup
    scores: torch.Tensor  # [n] shaped reward
    acc: torch.Tensor  # [n] bool
    answers: list[str] = field(default_factory=list)  # [n] extracted answers (RewardScorer(answers=True))


ScoreFn = Callable[[Sequence[PromptItem], Sequence[StoredGroup]], list[Group[ScoredGroup]]]


@dataclass
class Collected:
    groups: list[Group[ScoredGroup]]  # kept groups, in arrival order
    metrics: dict[str, float]


@dataclass
class Store:
    """Where a collection's rows go: the step's data-plane partition, and the manager's client of
    the data plane (metadata calls only: clearing dropped groups); None in tests without one."""
    partition: str
    plane: DataPlane | None = None
    # Called between two polls of a collection: the manager's deferred data-plane work (the
    # trainer's releases arrive while it collects; its data-plane client is this thread's).
    between: Callable[[], None] = lambda: None

    def clear(self, keys: list[str] | None = None) -> None:
        """Drop `keys` (None: the whole partition) from the data plane."""
        if self.plane is not None and (keys is None or keys):
            self.plane.clear(self.partition, keys)

    def clear_requests(self, request_ids: list[str]) -> None:
        """Drop the rows of requests whose answer never came: an engine stores a group's rows at
        the poll that returns it, and one killed (or hung) between the put and the reply leaves
        them behind while its prompt is generated again elsewhere."""
        if self.plane is not None and request_ids:
            ids = set(request_ids)
            self.clear([k for k in self.plane.keys(self.partition) if request_of(k) in ids])


@dataclass
class Source:
    """What every collection draws from, built once by the manager: the engines (a list the
    health monitor swaps replacements into), the prompt stream, dynamic sampling, the scorer."""
    engines: list
    dataset: PromptDataset
    prompts: PromptSampler
    sampler: DynamicSampler
    score: ScoreFn
    gen_batch_size: int
    health: EngineHealth | None = None
    # the policy version the engines hold, as the driver last said (manager.pushed, its control
    # thread; a collecting thread reads it): carrying's stale share waits on it
    version: int = 0
    # (step, version): that step's collection waits for the push after `version`, every response
    # held at its segment's end or finished (Sampling.segment_tokens); the driver's push may land
    held: tuple[int, int] | None = None


class Collection(Protocol):
    """One step's training groups: generate -> score -> dynamic sampling (rollout/collection/)."""

    def collect(self, step: int, sampling: Sampling, store: Store) -> Collected:
        """Until `source.sampler` is full (or its round budget is spent); `step` is 1-based."""

    def in_flight(self) -> list[PromptItem]:
        """Prompts generated past the last batch and not trained yet (a checkpoint returns them)."""


def tokens_of(groups: Sequence[Group | StoredGroup]) -> int:
    rollouts = [g.payload.rollout if isinstance(g, Group) else g for g in groups]
    return sum(sum(g.response_lengths) for g in rollouts)


def _keys(groups: Sequence[Group]) -> list[str]:
    return [k for g in groups for k in g.payload.rollout.data_keys]


def received(obj) -> int:
    """Bytes of a result the manager got (its pickle: what Ray moved into this process), each
    group's partition name counted as empty: the manager named it, and after a restart that kept
    the manager the same step's partition has another number (trainer.deterministic compares)."""
    def blank(group):
        return replace(group, partition="") if isinstance(group, StoredGroup) else group
    obj = [blank(g) for g in obj] if isinstance(obj, list) else blank(obj)
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


@dataclass
class Tokens:
    """Token accounting of one collection: scored, dropped by the filter, aborted; and, for
    multi-turn rollouts, the turns and tool calls of every scored response. Clears what the
    filter drops from the data plane, and counts the bytes the manager received."""
    store: Store
    scored: int = 0
    filtered: int = 0
    aborted: int = 0
    stale: int = 0  # of groups dropped for their policy lag (carried too long)
    stale_groups: int = 0
    responses: int = 0
    driver_bytes: int = 0
    tools: dict = field(default_factory=dict)

    def add(self, sampler: DynamicSampler, groups: list[Group]) -> None:
        kept = sampler.add(groups, new_round=False)
        kept_ids = {id(g) for g in kept}
        self.store.clear(_keys([g for g in groups if id(g) not in kept_ids]))
        self.scored += tokens_of(groups)
        self.responses += sum(len(g.payload.rollout.keys) for g in groups)
        self.filtered += tokens_of(groups) - tokens_of(kept)
        for g in groups:
            r = g.payload.rollout
            if r.turns:
                stats = {**r.tool_stats, "turns": sum(r.turns), "responses": len(r.turns)}
                self.tools = {k: self.tools.get(k, 0) + v for k, v in stats.items()}

    def tool_metrics(self) -> dict[str, float]:
        t = self.tools
        if not t:
            return {}
        return {"rollout/turns_mean": t["turns"] / t["responses"], "rollout/tool_calls": float(t["tool_calls"]),
                "rollout/tool_errors": float(t["tool_errors"]), "rollout/tool_timeouts": float(t["tool_timeouts"]),
                "timing/tools": float(t["tool_s"])}


def finish(sampler: DynamicSampler, tokens: Tokens) -> Collected:
    """take() the step's groups; waste = filtered (DAPO's own) + over-generation (surplus, aborts)."""
    metrics = {k.replace("dynamic_sampling/", "sampling/"): float(v) for k, v in sampler.metrics().items()}
    before = list(sampler.buffer)
    kept = sampler.take()
    taken = {id(g) for g in kept}
    tokens.store.clear(_keys([g for g in before if id(g) not in taken]))  # the surplus
    generated, kept_tokens = tokens.scored + tokens.aborted + tokens.stale, tokens_of(kept)
    metrics.update({"sampling/generated_tokens": float(generated), "sampling/kept_tokens": float(kept_tokens),
                    "sampling/discarded_tokens": float(generated - kept_tokens),
                    "sampling/filtered_tokens": float(tokens.filtered),
                    "sampling/overgenerated_tokens": float(generated - kept_tokens - tokens.filtered),
                    "sampling/aborted_tokens": float(tokens.aborted),
                    "driver/bytes": float(tokens.driver_bytes), "sampling/scored_responses": float(tokens.responses)},
                   **tokens.tool_metrics())
    return Collected(kept, metrics)


def groups_to_batch(groups: Sequence[Group[ScoredGroup]], partition: str) -> StepBatch:
    """Kept groups -> the step's StepBatch (keys and metadata); `group` is the group's position."""
    rows = [(gid, g.payload, j) for gid, g in enumerate(groups) for j in range(len(g.payload.rollout.keys))]
    fields = tuple(dict.fromkeys(f for g in groups for f in g.payload.rollout.fields))
    image_keys = [p.rollout.image_key for _, p, _ in rows]
    return StepBatch(partition, keys=[p.rollout.keys[j] for _, p, j in rows], group=[gid for gid, _, _ in rows],
                     image_keys=image_keys if any(image_keys) else [],
                     sequence_lengths=[p.rollout.prompt_length + p.rollout.response_lengths[j] for _, p, j in rows],
                     response_lengths=[p.rollout.response_lengths[j] for _, p, j in rows],
                     loss_tokens=[p.rollout.loss_tokens[j] for _, p, j in rows],
                     scores=[float(p.scores[j]) for _, p, j in rows], acc=[bool(p.acc[j]) for _, p, j in rows],
                     fields=fields, versions=[p.rollout.versions(j) for _, p, j in rows])
