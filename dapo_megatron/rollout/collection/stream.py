"""Streaming early stop (algorithm.filter_groups.mode=early_stop): prompts go to the engines as
capacity frees (least-loaded engine first), each group is scored as soon as its n responses
finish, and once the batch is full the requests still in flight are aborted. Aborted and
never-submitted prompts go back to the front of the prompt stream, so no prompt is skipped.
`Stream` is the state of one such collection; asynchronous carrying (carry.py) keeps it past the
batch."""
from __future__ import annotations

import itertools
import time
from collections import deque

import ray

from dapo_megatron.data.dataset import PromptItem
from dapo_megatron.rollout.collection.base import Collected, Source, Store, Tokens, finish, received, tokens_of
from dapo_megatron.rollout.health import EngineHealth
from dapo_megatron.rollout.types import Sampling, StoredGroup


class EarlyStop:
    """Stream prompts to the engines until train_batch_size groups are kept, then abort the rest."""

    def __init__(self, source: Source, max_concurrent_per_engine: int, poll_s: float = 0.05,
                 by_responses: bool = False, in_order: bool = False):
        self.source, self.max_concurrent_per_engine, self.poll_s = source, max_concurrent_per_engine, poll_s
        self.by_responses = by_responses  # rollout.admission=responses
        self.in_order = in_order  # trainer.deterministic: waves, kept in prompt order (`fill_in_waves`)
        self.step = 0  # of the collection under way

    def collect(self, step: int, sampling: Sampling, store: Store) -> Collected:
        run = self.stream(sampling, Tokens(store))
        self.step = step
        self.fill(run)
        returned, run.tokens.aborted = run.abort_all()
        return self.end(run, returned)

    def in_flight(self) -> list[PromptItem]:
        return []

    def stream(self, sampling: Sampling, tokens: Tokens) -> "Stream":
        s = self.source
        return Stream(s.engines, sampling, self.max_concurrent_per_engine, tokens, s.health, self.by_responses)

    def fill(self, run: "Stream", oldest_version: int | None = None, batches_after: int = 0) -> None:
        """Submit and score until the batch is full or the round budget is spent; groups older than
        `oldest_version` are dropped, and up to `batches_after` more batches' groups may be in
        flight beside this one's (asynchronous carrying)."""
        if self.in_order:
            return self.fill_in_waves(run)
        s = self.source
        while not s.sampler.is_full:
            self._next_round(run)
            # No more in flight than the batch still needs at the keep rate seen so far: the rest
            # would mostly be aborted (waste) when the batch fills.
            held = self.submit(run, s.sampler.groups_to_fill(batches_after))
            if not run.in_flight:
                if held:  # prompts wait for the next push (carrying's stale share)
                    time.sleep(self.poll_s)
                    continue
                break  # round budget spent and everything came back: train on what was kept
            self.score(run, run.poll(timeout=self.poll_s), oldest_version)

    def _next_round(self, run: "Stream") -> None:
        """The next gen_batch_size prompts queued once the queue is empty (a round of the budget)."""
        s = self.source
        if not run.queued and not s.sampler.exhausted:
            run.queued.extend(s.dataset[i] for i in s.prompts.next(s.gen_batch_size))
            s.sampler.start_round()

    def fill_in_waves(self, run: "Stream") -> None:
        """trainer.deterministic: waves of as many prompts as the batch still needs at the keep rate
        seen so far, each generated whole and scored in prompt order, so that the groups kept are
        a function of the prompts and seeds, not of which finished first; a wave's surplus is
        dropped as a recipe round's is. What it costs: each wave waits for its slowest group."""
        s = self.source
        while not s.sampler.is_full:
            self._next_round(run)
            need = s.sampler.groups_to_fill()
            wave = [run.queued.popleft() for _ in range(int(min(len(run.queued), need)))]
            if not wave:
                break  # round budget spent: train on what was kept
            self.score(run, run.generate_wave(wave, self._held if run.sampling.segment_tokens else None), None)
        s.held = None

    def _held(self, version: int | None) -> None:
        """Segments: the wave waits for the push after `version` (None: it generates)."""
        self.source.held = None if version is None else (self.step, version)

    def submit(self, run: "Stream", limit: float) -> bool:
        """Submit what `limit` allows; True when prompts were held back for a reason other than
        capacity (none here)."""
        run.submit_ready(limit)
        return False

    def score(self, run: "Stream", finished: list, oldest_version: int | None) -> None:
        """Finished groups into the sampler, those older than `oldest_version` dropped first."""
        if oldest_version is not None and finished:
            finished, stale = run.drop_stale(finished, oldest_version)
            self.source.prompts.push_back([it.index for it in stale])
        if finished:
            items, groups = zip(*finished)
            run.tokens.add(self.source.sampler, self.source.score(items, groups))

    def end(self, run: "Stream", returned: list[PromptItem]) -> Collected:
        """Aborted prompts back to the stream first, then the never-submitted ones, in their
        original order; the batch taken."""
        self.source.prompts.push_back([it.index for it in returned] + [it.index for it in run.queued])
        run.queued.clear()
        result = finish(self.source.sampler, run.tokens)
        result.metrics["sampling/aborted_groups"] = float(len(returned))
        return result


class Stream:
    """The state of one streaming collection: what is queued, in flight, and where. With
    `health`, an engine that dies (or finishes nothing for rollout.engine_timeout_s while it has
    requests) is reported and its in-flight prompts go back to the front of the queue. An engine
    takes a group while it has n of its max_concurrent_per_engine slots free: counted in groups
    (each holds n until its last response ends) or, `by_responses`, in the responses still running
    (as the engine last reported them, plus n per group submitted since)."""

    def __init__(self, engines: list, sampling: Sampling, max_concurrent_per_engine: int,
                 tokens: Tokens, health: EngineHealth | None = None, by_responses: bool = False):
        self.engines, self.sampling, self.tokens = engines, sampling, tokens
        self.health = health
        self.slots, self.by_responses = max(max_concurrent_per_engine, sampling.n), by_responses
        self.queued: deque[PromptItem] = deque()
        self.in_flight: dict[str, tuple[int, PromptItem]] = {}  # request id -> (engine, item)
        self.load = [0] * len(engines)  # groups in flight
        self.running = [0] * len(engines)  # by_responses: unfinished responses, as reported + n per group since
        self.progress = [time.monotonic()] * len(engines)  # an engine's last finished group (or first request)
        self.ids = itertools.count()

    def _alive(self) -> list[int]:
        return [e for e in range(len(self.engines)) if self.health is None or self.health.alive(e)]

    def submit_ready(self, limit: float) -> None:
        """Submit queued prompts while an engine has capacity and fewer than `limit` are in flight
        (again, elsewhere, when an engine died as they reached it)."""
        while True:
            if self.queued and not self._alive():
                self.health.wait_alive()  # the driver is starting a replacement
            calls: dict[int, list] = {}
            while self.queued and len(self.in_flight) < limit:
                e = min(self._alive(), key=self._taken)  # least-loaded engine first
                if self._taken(e) + self.sampling.n > self.slots:
                    break
                item = self.queued.popleft()
                rid = f"g{next(self.ids)}-p{item.index}"
                self.in_flight[rid] = (e, item)
                if not self.load[e]:
                    self.progress[e] = time.monotonic()
                self.load[e] += 1
                if self.by_responses:
                    self.running[e] += self.sampling.n
                calls.setdefault(e, []).append(self.engines[e].submit.remote(
                    rid, item.prompt, self.sampling, index=item.index, partition=self.tokens.store.partition))
            if len(self._answers(calls)) == len(calls):
                return

    def generate_wave(self, wave: list[PromptItem], held=None) -> list[tuple[PromptItem, StoredGroup]]:
        """Every prompt of `wave` generated (submitted as capacity frees, again elsewhere when an
        engine dies), the groups returned in the wave's order; the rest of the queue waits.
        held(version): told, after each poll that brought nothing, whether the wave waits for a
        push (segments: `waiting_for_push`)."""
        rest, self.queued = self.queued, deque(wave)
        done = []
        try:
            while self.queued or self.in_flight:
                self.submit_ready(len(wave))
                got = self.poll(timeout=0.05)
                if held is not None and self.in_flight:
                    held(None if got else self.waiting_for_push())
                done += got
        finally:
            self.queued = rest
        position = {id(item): k for k, item in enumerate(wave)}
        return sorted(done, key=lambda pair: position[id(pair[0])])

    def poll(self, timeout: float, only: set[str] | None = None) -> list[tuple[PromptItem, StoredGroup]]:
        """Finished groups; `only`: just these request ids (the others stay in their engines)."""
        self.tokens.store.between()
        done, asked = [], time.monotonic()
        if only is None:
            calls = {e: self.engines[e].poll.remote(timeout=timeout) for e in self._alive() if self.load[e]}
        else:
            calls = {e: self.engines[e].poll.remote(timeout=timeout, only=rids) for e, rids in self._by_engine(only).items()}
        if self.by_responses:  # asked beside the poll: as of its start, so it errs on the full side
            calls = {e: [ref, self.engines[e].running.remote()] for e, ref in calls.items()}
        busy = list(calls)
        answers = self._answers(calls, wait_s=timeout)
        for e, results in answers.items():
            if self.by_responses:
                results, self.running[e] = results
            # group by group: the same count however the groups were spread over polls
            self.tokens.driver_bytes += sum(received(group) for group in results)
            if results:
                self.progress[e] = time.monotonic()
            for group in results:
                _, item = self.in_flight.pop(group.request_id)
                self.load[e] -= 1
                done.append((item, group))
            if self.by_responses:
                self.running[e] = min(self.running[e], self.load[e] * self.sampling.n)
        # An answer tells what had finished when the poll was asked (a hung peer may have kept
        # this loop waiting since), so an engine's silence is measured up to then.
        # (Not while a batch waits for its stragglers: the others finish unpolled, so silence
        # there is no sign of a hang; a dead engine is still seen.)
        limit = self.health.timeout_s if self.health is not None and only is None else 0.0
        for e in busy:
            if limit and self.health.alive(e) and self.load[e] and asked - self.progress[e] > limit:
                self.health.hung(e, asked - self.progress[e], self._requeue(e))
        return done

    def _answers(self, refs: dict, wait_s: float = 0.0) -> dict:
        """engine -> the answer of its call(s); an engine that died (or did not answer within
        rollout.engine_timeout_s past `wait_s`) is reported and left out. Without health: ray.get."""
        flat = [r for v in refs.values() for r in (v if isinstance(v, list) else [v])]
        if self.health is None:
            answers = iter(ray.get(flat))
            return {e: [next(answers) for _ in v] if isinstance(v, list) else next(answers) for e, v in refs.items()}
        limit = self.health.timeout_s
        ray.wait(flat, num_returns=len(flat), timeout=wait_s + limit if limit else None)
        out = {}
        for e, ref in refs.items():
            try:
                out[e] = ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError as exc:
                self.health.report(e, exc, self._requeue(e))
            except ray.exceptions.GetTimeoutError:
                self.health.hung(e, limit, self._requeue(e))
        return out

    def waiting_for_push(self) -> int | None:
        """The version under which every engine with groups in flight waits for the next push
        (`Engine.waiting_for_push`), else None. Waiting is not silence: no hang is counted."""
        asked = [e for e in self._alive() if self.load[e]]
        answers = self._answers({e: self.engines[e].waiting_for_push.remote() for e in asked})
        versions = set(answers.values())
        if len(answers) < len(asked) or len(versions) != 1 or None in versions:
            return None
        for e in asked:
            self.progress[e] = time.monotonic()
        return versions.pop()

    def _taken(self, e: int) -> int:
        """Engine e's slots in use: n per group in flight, or its unfinished responses (by_responses)."""
        return self.running[e] if self.by_responses else self.load[e] * self.sampling.n

    def _requeue(self, engine: int) -> int:
        """A dead engine's in-flight prompts back to the front of the queue; returns how many."""
        lost = [(rid, item) for rid, (e, item) in self.in_flight.items() if e == engine]
        for rid, _ in lost:
            del self.in_flight[rid]
        self.tokens.store.clear_requests([rid for rid, _ in lost])
        self.queued.extendleft(reversed([item for _, item in lost]))
        self.load[engine] = self.running[engine] = 0
        return len(lost)

    def _by_engine(self, rids: set[str] | None = None) -> dict[int, list[str]]:
        """engine -> its request ids in flight (among `rids`; None: all)."""
        out: dict[int, list[str]] = {}
        for rid, (e, _) in self.in_flight.items():
            if rids is None or rid in rids:
                out.setdefault(e, []).append(rid)
        return out

    def take_over(self, sampling: Sampling, tokens: Tokens) -> "Stream":
        """The next collection goes on with this one's groups in flight: the engines store them in
        its partition once finished (each stores what it returns from a poll, and none is running)."""
        self.sampling, self.tokens = sampling, tokens
        self._answers({e: self.engines[e].carry.remote(rids, tokens.store.partition)
                       for e, rids in self._by_engine().items()})
        return self

    def older_than(self, version: int) -> set[str]:
        """The groups in flight (or finished, not yet polled) with a token older than `version`."""
        answers = self._answers({e: self.engines[e].oldest_versions.remote(rids) for e, rids in self._by_engine().items()})
        return {rid for versions in answers.values() for rid, v in versions.items() if v < version}

    def drop_stale(self, finished: list, oldest_version: int) -> tuple[list, list[PromptItem]]:
        """Groups with a token older than `oldest_version` (carried across more pushes than
        trainer.max_staleness allows) are dropped, as verl's max_off_policy_strategy=drop: their
        rows cleared, their prompts returned to the stream."""
        keep, stale = [], []
        for item, group in finished:
            if group.oldest_version < oldest_version:
                stale.append(item)
                self.tokens.stale += tokens_of([group])
                self.tokens.stale_groups += 1
                self.tokens.store.clear(group.data_keys)
            else:
                keep.append((item, group))
        return keep, stale

    def abort_all(self, rids: set[str] | None = None) -> tuple[list[PromptItem], int]:
        """Abort what is in flight (`rids`: these groups only), wait for the aborted groups; returns
        their prompts and tokens."""
        self._answers({e: self.engines[e].abort.remote(ids) for e, ids in self._by_engine(rids).items()})
        returned, tokens = [], 0
        while self.in_flight if rids is None else self.in_flight.keys() & rids:
            for item, group in self.poll(timeout=0.5, only=rids):
                returned.append(item)
                tokens += tokens_of([group])
                # one that finished before its abort arrived was stored: nobody trains on it
                self.tokens.store.clear(group.data_keys)
        return returned, tokens
