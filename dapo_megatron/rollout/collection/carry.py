"""Asynchronous carrying (trainer.mode=async with trainer.partial_rollout): a streaming collection
whose groups still in flight when the batch fills go on generating, across weight pushes, into
the next collections instead of being aborted. A group trained at step s (s - 1 pushes done) may
lag trainer.max_staleness pushes: older ones are dropped when they finish, their prompts back in
the stream (stale_strategy=drop), or the batch waits for those the next one would drop (wait)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from dapo_megatron.config.schema import TrainerConfig
from dapo_megatron.data.dataset import PromptItem
from dapo_megatron.rollout.collection.base import Collected, Source, Store, Tokens
from dapo_megatron.rollout.collection.stream import EarlyStop, Stream
from dapo_megatron.rollout.types import Sampling


@dataclass(frozen=True)
class Staleness:
    """The asynchronous knobs, read once from trainer.*: how many pushes a trained token may lag,
    and whether a batch waits for the stragglers the next one would drop."""
    max_staleness: int
    wait: bool = False

    @classmethod
    def from_config(cls, trainer: TrainerConfig) -> "Staleness":
        return cls(trainer.max_staleness, trainer.stale_strategy == "wait")

    def oldest_version(self, step: int) -> int:
        """The oldest policy version a group trained at `step` may hold."""
        return step - 1 - self.max_staleness

    @property
    def batches_after(self) -> int:
        """Batches beyond this one whose groups may be in flight beside it."""
        return self.max_staleness - 1


class Carrying(EarlyStop):
    """Early stop that keeps what is in flight (`carried`) for the next collection."""

    def __init__(self, source: Source, max_concurrent_per_engine: int, staleness: Staleness, poll_s: float = 0.05):
        super().__init__(source, max_concurrent_per_engine, poll_s)
        self.staleness = staleness
        self.carried: Stream | None = None  # None while a collection runs: it owns them

    def collect(self, step: int, sampling: Sampling, store: Store) -> Collected:
        tokens, stale = Tokens(store), self.staleness
        carried, self.carried = self.carried, None
        run = carried.take_over(sampling, tokens) if carried is not None else self.stream(sampling, tokens)
        oldest = stale.oldest_version(step)
        self.fill(run, oldest, stale.batches_after)
        waited, t_wait = set(), time.monotonic()
        if stale.wait and self.source.sampler.is_full:
            waited = pending = run.older_than(oldest + 1)
            while pending:  # nothing more is submitted meanwhile: a new group could be as old
                self.score(run, run.poll(timeout=self.poll_s, only=pending), oldest)
                pending = pending & run.in_flight.keys()  # finished, or requeued from a dead engine
            # the oldest first into the batch: the surplus of fresh groups is what take() clears
            self.source.sampler.buffer.sort(key=lambda g: g.payload.rollout.oldest_version)
        result = self.end(run, [])
        result.metrics.update({"sampling/stale_groups": float(tokens.stale_groups),
                               "sampling/stale_tokens": float(tokens.stale)})
        if stale.wait:
            result.metrics.update({"sampling/waited_groups": float(len(waited)),
                                   "timing/stale_wait": time.monotonic() - t_wait if waited else 0.0})
        result.metrics["sampling/carried_groups"] = float(len(run.in_flight))
        self.carried = run if run.in_flight else None
        return result

    def in_flight(self) -> list[PromptItem]:
        return [item for _, item in self.carried.in_flight.values()] if self.carried is not None else []
