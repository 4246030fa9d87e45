"""Asynchronous carrying (trainer.mode=async with trainer.partial_rollout): a streaming collection
whose groups still in flight when the batch fills go on generating, across weight pushes, into
the next collections instead of being aborted. A group trained at step s (s - 1 pushes done) may
lag trainer.max_staleness pushes: older ones are dropped when they finish, their prompts back in
the stream (stale_strategy=drop), or the batch waits for those the next one would drop (wait).
With trainer.stale_share, at most that share of a batch's groups may have started before its
last push: no group starts stale past it (prompts wait for the push), and carried ones past it
are aborted when the collection starts, their prompts back in the stream."""
from __future__ import annotations

import math
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
    share: float | None = None  # of a batch's groups started before its last push (trainer.stale_share)

    @classmethod
    def from_config(cls, trainer: TrainerConfig) -> "Staleness":
        return cls(trainer.max_staleness, trainer.stale_strategy == "wait", trainer.stale_share)

    def quota(self, batch_size: int) -> int | None:
        """Stale groups a batch may hold (None: no share bound)."""
        return None if self.share is None else math.floor(self.share * batch_size + 1e-9)

    def oldest_version(self, step: int) -> int:
        """The oldest policy version a group trained at `step` may hold."""
        return step - 1 - self.max_staleness

    @property
    def batches_after(self) -> int:
        """Batches beyond this one whose groups may be in flight beside it."""
        return self.max_staleness - 1


class Carrying(EarlyStop):
    """Early stop that keeps what is in flight (`carried`) for the next collection."""

    def __init__(self, source: Source, max_concurrent_per_engine: int, staleness: Staleness, poll_s: float = 0.05,
                 by_responses: bool = False):
        super().__init__(source, max_concurrent_per_engine, poll_s, by_responses)
        self.staleness = staleness
        self.carried: Stream | None = None  # None while a collection runs: it owns them
        self.quota = staleness.quota(source.sampler.train_batch_size)  # stale groups a batch may hold
        # the share bound, in the collection under way: the version a group must start under to be
        # fresh, the stale groups in flight, the seconds prompts waited for a push
        self.fresh, self.stale, self.held_s, self.hold_since = 0, set(), 0.0, None

    def collect(self, step: int, sampling: Sampling, store: Store) -> Collected:
        tokens, stale = Tokens(store), self.staleness
        carried, self.carried = self.carried, None
        run = carried.take_over(sampling, tokens) if carried is not None else self.stream(sampling, tokens)
        oldest = stale.oldest_version(step)
        aborted = self._bound_share(run, step)
        self.fill(run, oldest, stale.batches_after)
        self._hold(False)
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
        if self.quota is not None:
            result.metrics.update({"sampling/stale_aborted_groups": float(aborted),
                                   "timing/stale_hold": self.held_s})
        self.carried = run if run.in_flight else None
        return result

    def _bound_share(self, run: Stream, step: int) -> int:
        """The share bound's state for this collection: every carried group started before the push
        this batch trains after (step - 1); those past the quota are aborted, their prompts back in
        the stream (a checkpoint would return them too). Returns how many were aborted."""
        self.fresh, self.held_s, self.hold_since = step - 1, 0.0, None
        self.stale = set(run.in_flight)
        if self.quota is None or len(self.stale) <= self.quota:
            return 0
        # the last submitted (the fewest tokens generated) go back first: in_flight is in submission order
        excess = set(list(run.in_flight)[self.quota:])
        returned, run.tokens.aborted = run.abort_all(excess)
        self.source.prompts.push_back([item.index for item in returned])
        self.stale -= excess
        return len(excess)

    def submit(self, run: Stream, limit: float) -> bool:
        """Prompts start stale (the engines still hold weights older than `fresh`) only while the
        stale groups kept and in flight are under the quota; the rest wait for the push."""
        if self.quota is None or self.source.version >= self.fresh:
            self._hold(False)
            run.submit_ready(limit)
            return False
        self.stale &= run.in_flight.keys()
        kept = sum(g.payload.rollout.oldest_version < self.fresh for g in self.source.sampler.buffer)
        room = max(self.quota - kept - len(self.stale), 0)
        before = set(run.in_flight)
        run.submit_ready(min(limit, len(run.in_flight) + room))
        started = run.in_flight.keys() - before
        self.stale |= started
        held = bool(run.queued) and len(run.in_flight) < limit and len(started) == room  # the quota, not capacity
        self._hold(held)
        return held

    def _hold(self, held: bool) -> None:
        """Time prompts wait for a push (`timing/stale_hold`), from the first submit that held
        them to the first that did not (or the collection's end)."""
        now = time.monotonic()
        if held and self.hold_since is None:
            self.hold_since = now
        elif not held and self.hold_since is not None:
            self.held_s, self.hold_since = self.held_s + now - self.hold_since, None

    def in_flight(self) -> list[PromptItem]:
        return [item for _, item in self.carried.in_flight.values()] if self.carried is not None else []
