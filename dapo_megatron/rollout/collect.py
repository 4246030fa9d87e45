"""Collect one step's training groups: generate -> score -> dynamic sampling, in two modes (the
rollout manager's work, rollout/manager.py).

sync:       the DAPO recipe. Rounds of data.gen_batch_size prompts are generated whole, scored and
            filtered until train_batch_size groups are kept (or max_num_gen_batches rounds ran).
early_stop: prompts go to the engines as capacity frees (least-loaded engine first), each group
            is scored as soon as its n responses finish, and once the batch is full the requests
            still in flight are aborted. Aborted and never-submitted prompts go back to the front
            of the prompt stream, so no prompt is skipped.
Engines are Ray actor handles with the `rollout.Engine` methods, called with the step's
data-plane partition: they store each group's tokens there and return `StoredGroup`s (keys and
lengths). `score` turns those into `algo.Group`s whose payload is a `ScoredGroup` (the reward
worker reads the responses from the data plane), so tests can swap the reward. Groups the filter
drops are cleared from the data plane at once, the surplus when the batch is taken; aborted
groups were never stored. `driver/bytes` counts what the collecting process (the manager: the
control plane) received from the engines.
"""
from __future__ import annotations

import itertools
import pickle
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import ray
import torch

from dapo_megatron.algo import DynamicSampler, Group
from dapo_megatron.data.dataset import PromptDataset, PromptItem
from dapo_megatron.data.sampler import PromptSampler
from dapo_megatron.dataplane import DataPlane, StepBatch
from dapo_megatron.rollout.health import EngineHealth
from dapo_megatron.rollout.types import Sampling, StoredGroup


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
    # early stop with carry: the groups still in flight when the batch filled, which the next
    # collection takes over (partial rollouts across batches) instead of aborting them
    carried: "_EarlyStop | None" = None


def _tokens(groups: Sequence[Group | StoredGroup]) -> int:
    rollouts = [g.payload.rollout if isinstance(g, Group) else g for g in groups]
    return sum(sum(g.response_lengths) for g in rollouts)


def _keys(groups: Sequence[Group]) -> list[str]:
    return [k for g in groups for k in g.payload.rollout.data_keys]


def received(obj) -> int:
    """Bytes of a result the manager got (its pickle: what Ray moved into this process)."""
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _split(items: list, parts: int) -> list[list]:
    return [items[i::parts] for i in range(parts)]


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


def collect_sync(engines: list, dataset: PromptDataset, prompts: PromptSampler, sampler: DynamicSampler,
                 score: ScoreFn, sampling: Sampling, gen_batch_size: int, store: Store,
                 health: EngineHealth | None = None) -> Collected:
    """Recipe rounds: generate gen_batch_size prompts on all engines, score, filter, repeat."""
    tokens = _Tokens(store)
    while not sampler.should_stop():
        items = [dataset[i] for i in prompts.next(gen_batch_size)]
        shards = _split(items, len(engines))
        for shard, results in zip(shards, _generate_round(engines, health, shards, sampling, store.partition)):
            tokens.driver_bytes += received(results)
            if shard:
                tokens.add(sampler, score(shard, results))
        sampler.start_round()
        store.between()
    return _finish(sampler, tokens)


def _generate_round(engines: list, health: EngineHealth | None, shards: list[list[PromptItem]],
                    sampling: Sampling, partition: str) -> list:
    """Shard i on engine i. With `health`, the shard of an engine that died (or answered nothing
    in rollout.engine_timeout_s) is generated again on a live one, the replacement when none is
    left: per-prompt seeds make it the same sample under the same weights."""
    def call(e: int, shard: list[PromptItem]):
        return engines[e].generate.remote([it.prompt for it in shard], sampling, partition)
    if health is None:
        return ray.get([call(e, shard) for e, shard in enumerate(shards)])
    results, todo = [None] * len(shards), list(range(len(shards)))
    while todo:
        alive = [e for e in range(len(engines)) if health.alive(e)]
        if not alive:
            health.wait_alive()
            continue
        runs = {i: (i if health.alive(i) else alive[k % len(alive)]) for k, i in enumerate(todo)}
        refs = {i: call(e, shards[i]) for i, e in runs.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=health.timeout_s or None)
        todo = []
        for i, ref in refs.items():
            e = runs[i]
            try:
                results[i] = ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError as exc:
                todo.append(i)
                if health.alive(e):
                    health.report(e, exc, len(shards[i]))
            except ray.exceptions.GetTimeoutError:
                todo.append(i)
                if health.alive(e):
                    health.hung(e, health.timeout_s, len(shards[i]))
    return results


@dataclass
class _Tokens:
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
        self.scored += _tokens(groups)
        self.responses += sum(len(g.payload.rollout.keys) for g in groups)
        self.filtered += _tokens(groups) - _tokens(kept)
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


def _finish(sampler: DynamicSampler, tokens: _Tokens) -> Collected:
    """take() the step's groups; waste = filtered (DAPO's own) + over-generation (surplus, aborts)."""
    metrics = {k.replace("dynamic_sampling/", "sampling/"): float(v) for k, v in sampler.metrics().items()}
    before = list(sampler.buffer)
    kept = sampler.take()
    taken = {id(g) for g in kept}
    tokens.store.clear(_keys([g for g in before if id(g) not in taken]))  # the surplus
    generated, kept_tokens = tokens.scored + tokens.aborted + tokens.stale, _tokens(kept)
    metrics.update({"sampling/generated_tokens": float(generated), "sampling/kept_tokens": float(kept_tokens),
                    "sampling/discarded_tokens": float(generated - kept_tokens),
                    "sampling/filtered_tokens": float(tokens.filtered),
                    "sampling/overgenerated_tokens": float(generated - kept_tokens - tokens.filtered),
                    "sampling/aborted_tokens": float(tokens.aborted),
                    "driver/bytes": float(tokens.driver_bytes), "sampling/scored_responses": float(tokens.responses)},
                   **tokens.tool_metrics())
    return Collected(kept, metrics)


class _EarlyStop:
    """The state of one early-stop collection: what is queued, in flight, and where. With
    `health`, an engine that dies (or finishes nothing for rollout.engine_timeout_s while it has
    requests) is reported and its in-flight prompts go back to the front of the queue."""

    def __init__(self, engines: list, dataset: PromptDataset, sampling: Sampling, max_concurrent_per_engine: int,
                 tokens: _Tokens, health: EngineHealth | None = None):
        self.engines, self.dataset, self.sampling, self.tokens = engines, dataset, sampling, tokens
        self.health = health
        # Capacity in groups: an engine runs n requests per prompt.
        self.capacity = max(1, max_concurrent_per_engine // sampling.n)
        self.queued: deque[PromptItem] = deque()
        self.in_flight: dict[str, tuple[int, PromptItem]] = {}  # request id -> (engine, item)
        self.load = [0] * len(engines)
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
                e = min(self._alive(), key=self.load.__getitem__)  # least-loaded engine first
                if self.load[e] >= self.capacity:
                    break
                item = self.queued.popleft()
                rid = f"g{next(self.ids)}-p{item.index}"
                self.in_flight[rid] = (e, item)
                if not self.load[e]:
                    self.progress[e] = time.monotonic()
                self.load[e] += 1
                calls.setdefault(e, []).append(self.engines[e].submit.remote(
                    rid, item.prompt, self.sampling, index=item.index, partition=self.tokens.store.partition))
            if len(self._answers(calls)) == len(calls):
                return

    def poll(self, timeout: float, only: set[str] | None = None) -> list[tuple[PromptItem, StoredGroup]]:
        """Finished groups; `only`: just these request ids (the others stay in their engines)."""
        self.tokens.store.between()
        done, asked = [], time.monotonic()
        if only is None:
            calls = {e: self.engines[e].poll.remote(timeout=timeout) for e in self._alive() if self.load[e]}
        else:
            calls = {e: self.engines[e].poll.remote(timeout=timeout, only=rids) for e, rids in self._by_engine(only).items()}
        busy = list(calls)
        answers = self._answers(calls, wait_s=timeout)
        for e, results in answers.items():
            self.tokens.driver_bytes += received(results)
            if results:
                self.progress[e] = time.monotonic()
            for group in results:
                _, item = self.in_flight.pop(group.request_id)
                self.load[e] -= 1
                done.append((item, group))
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

    def _requeue(self, engine: int) -> int:
        """A dead engine's in-flight prompts back to the front of the queue; returns how many."""
        lost = [(rid, item) for rid, (e, item) in self.in_flight.items() if e == engine]
        for rid, _ in lost:
            del self.in_flight[rid]
        self.queued.extendleft(reversed([item for _, item in lost]))
        self.load[engine] = 0
        return len(lost)

    def _by_engine(self, rids: set[str] | None = None) -> dict[int, list[str]]:
        """engine -> its request ids in flight (among `rids`; None: all)."""
        out: dict[int, list[str]] = {}
        for rid, (e, _) in self.in_flight.items():
            if rids is None or rid in rids:
                out.setdefault(e, []).append(rid)
        return out

    def take_over(self, sampling: Sampling, tokens: _Tokens) -> "_EarlyStop":
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
                self.tokens.stale += _tokens([group])
                self.tokens.stale_groups += 1
                self.tokens.store.clear(group.data_keys)
            else:
                keep.append((item, group))
        return keep, stale

    def abort_all(self) -> tuple[list[PromptItem], int]:
        """Abort what is in flight, wait for the aborted groups; returns their prompts and tokens."""
        self._answers({e: self.engines[e].abort.remote(rids) for e, rids in self._by_engine().items()})
        returned, tokens = [], 0
        while self.in_flight:
            for item, group in self.poll(timeout=0.5):
                returned.append(item)
                tokens += _tokens([group])
                # one that finished before its abort arrived was stored: nobody trains on it
                self.tokens.store.clear(group.data_keys)
        return returned, tokens


def collect_early_stop(engines: list, dataset: PromptDataset, prompts: PromptSampler, sampler: DynamicSampler,
                       score: ScoreFn, sampling: Sampling, gen_batch_size: int, store: Store,
                       max_concurrent_per_engine: int, poll_s: float = 0.05,
                       health: EngineHealth | None = None, carried: _EarlyStop | None = None,
                       carry: bool = False, oldest_version: int | None = None, batches_after: int = 0,
                       wait: bool = False) -> Collected:
    """Stream prompts to the engines until train_batch_size groups are kept, then abort the rest;
    with `carry` (async partial rollouts) the rest stays in flight for the next collection
    (`Collected.carried`, passed back as `carried`), whose groups older than `oldest_version`
    are dropped, and up to `batches_after` more batches' groups are in flight beside this one's.
    `wait` (trainer.stale_strategy=wait): the full batch also waits for the groups in flight that
    the next collection would drop, and trains on them first."""
    tokens = _Tokens(store)
    if carried is not None:
        run = carried.take_over(sampling, tokens)
    else:
        run = _EarlyStop(engines, dataset, sampling, max_concurrent_per_engine, tokens, health)
    while not sampler.is_full:
        if not run.queued and not sampler.exhausted:
            run.queued.extend(dataset[i] for i in prompts.next(gen_batch_size))
            sampler.start_round()
        # No more in flight than the batch still needs at the keep rate seen so far: the rest
        # would mostly be aborted (waste) when the batch fills.
        run.submit_ready(sampler.groups_to_fill(batches_after))
        if not run.in_flight:
            break  # round budget spent and everything came back: train on what was kept
        _score(run.poll(timeout=poll_s), run, prompts, sampler, score, oldest_version)
    waited, t_wait = set(), time.monotonic()
    if wait and carry and oldest_version is not None and sampler.is_full:
        waited = pending = run.older_than(oldest_version + 1)
        while pending:  # nothing more is submitted meanwhile: a new group could be as old
            _score(run.poll(timeout=poll_s, only=pending), run, prompts, sampler, score, oldest_version)
            pending = pending & run.in_flight.keys()  # finished, or requeued from a dead engine
        # the oldest first into the batch: the surplus of fresh groups is what take() clears
        sampler.buffer.sort(key=lambda g: g.payload.rollout.oldest_version)
    returned, tokens.aborted = run.abort_all() if not carry else ([], 0)
    # Aborted prompts first, then the never-submitted ones, in their original order.
    prompts.push_back([it.index for it in returned] + [it.index for it in run.queued])
    run.queued.clear()
    result = _finish(sampler, tokens)
    result.metrics["sampling/aborted_groups"] = float(len(returned))
    if oldest_version is not None:
        result.metrics.update({"sampling/stale_groups": float(tokens.stale_groups),
                               "sampling/stale_tokens": float(tokens.stale)})
    if wait:
        result.metrics.update({"sampling/waited_groups": float(len(waited)),
                               "timing/stale_wait": time.monotonic() - t_wait if waited else 0.0})
    if carry:
        result.metrics["sampling/carried_groups"] = float(len(run.in_flight))
        result.carried = run if run.in_flight else None
    return result


def _score(finished: list, run: _EarlyStop, prompts: PromptSampler, sampler: DynamicSampler, score: ScoreFn,
           oldest_version: int | None) -> None:
    """Finished groups into the sampler, those older than `oldest_version` dropped first."""
    if oldest_version is not None and finished:
        finished, stale = run.drop_stale(finished, oldest_version)
        prompts.push_back([it.index for it in stale])
    if finished:
        items, groups = zip(*finished)
        run.tokens.add(sampler, score(items, groups))


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


class RewardScorer:
    """ScoreFn over the reward worker (`rollout/reward_worker.py`, in the manager's process): it
    reads the groups' responses from the data plane and scores them; the manager gets a score and
    an acc per response.

    The filter metric is `algorithm.filter_groups.metric`: `acc` uses correctness, the others the
    shaped score. Reward metrics of all calls in a step are averaged by `pop_metrics()`.
    """

    def __init__(self, reward, metric: str, answers: bool = False):
        self.reward, self.metric, self.answers = reward, metric, answers
        self._metrics: list[dict] = []
        self._sums = [0.0, 0.0, 0]  # score, acc, responses: the sampled reward before filtering

    def __call__(self, items: Sequence[PromptItem], groups: Sequence[StoredGroup]) -> list[Group]:
        per_response = [it for it, g in zip(items, groups) for _ in g.keys]
        keys = [k for g in groups for k in g.keys]
        partitions = {g.partition for g in groups}
        if len(partitions) != 1:
            raise ValueError(f"groups of one score call come from one partition, got {sorted(partitions)}")
        reply = self.reward.score(partitions.pop(), keys, [it.ground_truth for it in per_response],
                                  [it.data_source for it in per_response], [it.extra_info for it in per_response],
                                  self.answers)
        scores, acc, metrics = torch.tensor(reply[0], dtype=torch.float32), torch.tensor(reply[1]), reply[2]
        self._metrics.append(metrics)
        self._sums = [self._sums[0] + scores.sum().item(), self._sums[1] + acc.sum().item(),
                      self._sums[2] + len(keys)]
        out, start = [], 0
        for item, group in zip(items, groups):
            sl = slice(start, start + len(group.keys))
            start = sl.stop
            values = acc[sl].float() if self.metric == "acc" else scores[sl]
            answers = reply[3][sl] if self.answers else []
            out.append(Group(values.tolist(), ScoredGroup(item, group, scores[sl], acc[sl], answers)))
        return out

    def pop_metrics(self) -> dict[str, float]:
        """Reward metrics of the step: `reward/mean`, `acc/mean` over every scored response (the
        sampled reward, before dynamic sampling), and the reward manager's metrics averaged."""
        rows, self._metrics = self._metrics, []
        (score, acc, count), self._sums = self._sums, [0.0, 0.0, 0]
        keys = {k for r in rows for k in r}
        out = {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys}
        if count:
            out.update({"reward/mean": score / count, "acc/mean": acc / count})
        return out
