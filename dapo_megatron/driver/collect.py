"""Collect one step's training groups: generate -> score -> dynamic sampling, in two modes.

sync:       the DAPO recipe. Rounds of data.gen_batch_size prompts are generated whole, scored and
            filtered until train_batch_size groups are kept (or max_num_gen_batches rounds ran).
early_stop: prompts go to the engines as capacity frees (least-loaded engine first), each group
            is scored as soon as its n responses finish, and once the batch is full the requests
            still in flight are aborted. Aborted and never-submitted prompts go back to the front
            of the prompt stream, so no prompt is skipped.
Engines are Ray actor handles with the `rollout.Engine` methods; `score` turns finished
`RolloutGroup`s into `algo.Group`s whose payload is a `ScoredGroup`, so tests can swap the reward.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import ray
import torch

from dapo_megatron.algo import DynamicSampler, Group
from dapo_megatron.batch import RolloutBatch
from dapo_megatron.data.dataset import PromptDataset, PromptItem
from dapo_megatron.data.sampler import PromptSampler
from dapo_megatron.rollout.types import RolloutGroup, Sampling


@dataclass
class ScoredGroup:
    """What a group carries from scoring to the batch: its prompt, its n responses, their rewards."""
    item: PromptItem
    rollout: RolloutGroup
    scores: torch.Tensor  # [n] shaped reward
    acc: torch.Tensor  # [n] bool

    def samples(self, group: int) -> Iterator[dict]:
        """One `RolloutBatch.from_samples` row per response; `group`: this group's position in the step.
        `loss_mask` from multi-turn rollouts (tool tokens out); else every token counts (the default)."""
        r = self.rollout
        for j, response in enumerate(r.responses):
            sample = dict(prompts=r.prompt, responses=response, rollout_logprobs=r.rollout_logprobs[j],
                          finish_reasons=r.finish_reasons[j], group=group, prompt_index=self.item.index,
                          scores=float(self.scores[j]), acc=bool(self.acc[j]))
            if r.loss_masks:
                sample["loss_mask"] = r.loss_masks[j]
            routes = r.route_positions(j)
            if routes is not None:
                sample["routed_experts"] = routes
            yield sample


ScoreFn = Callable[[Sequence[PromptItem], Sequence[RolloutGroup]], list[Group[ScoredGroup]]]


@dataclass
class Collected:
    groups: list[Group[ScoredGroup]]  # kept groups, in arrival order
    metrics: dict[str, float]


def _tokens(groups: Sequence[Group | RolloutGroup]) -> int:
    rollouts = [g.payload.rollout if isinstance(g, Group) else g for g in groups]
    return sum(len(r) for g in rollouts for r in g.responses)


def _split(items: list, parts: int) -> list[list]:
    return [items[i::parts] for i in range(parts)]


def collect_sync(engines: list, dataset: PromptDataset, prompts: PromptSampler, sampler: DynamicSampler,
                 score: ScoreFn, sampling: Sampling, gen_batch_size: int) -> Collected:
    """Recipe rounds: generate gen_batch_size prompts on all engines, score, filter, repeat."""
    tokens = _Tokens()
    while not sampler.should_stop():
        items = [dataset[i] for i in prompts.next(gen_batch_size)]
        shards = _split(items, len(engines))
        futures = [e.generate.remote([it.prompt for it in shard], sampling) for e, shard in zip(engines, shards)]
        for shard, results in zip(shards, ray.get(futures)):
            if shard:
                tokens.add(sampler, score(shard, results))
        sampler.start_round()
    return _finish(sampler, tokens)


@dataclass
class _Tokens:
    """Token accounting of one collection: scored, dropped by the filter, aborted; and, for
    multi-turn rollouts, the turns and tool calls of every scored response."""
    scored: int = 0
    filtered: int = 0
    aborted: int = 0
    tools: dict = field(default_factory=dict)

    def add(self, sampler: DynamicSampler, groups: list[Group]) -> None:
        kept = sampler.add(groups, new_round=False)
        self.scored += _tokens(groups)
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
    kept = sampler.take()
    generated, kept_tokens = tokens.scored + tokens.aborted, _tokens(kept)
    metrics.update({"sampling/generated_tokens": float(generated), "sampling/kept_tokens": float(kept_tokens),
                    "sampling/discarded_tokens": float(generated - kept_tokens),
                    "sampling/filtered_tokens": float(tokens.filtered),
                    "sampling/overgenerated_tokens": float(generated - kept_tokens - tokens.filtered),
                    "sampling/aborted_tokens": float(tokens.aborted)}, **tokens.tool_metrics())
    return Collected(kept, metrics)


class _EarlyStop:
    """The state of one early-stop collection: what is queued, in flight, and where."""

    def __init__(self, engines: list, dataset: PromptDataset, sampling: Sampling, max_concurrent_per_engine: int):
        self.engines, self.dataset, self.sampling = engines, dataset, sampling
        # Capacity in groups: an engine runs n requests per prompt.
        self.capacity = max(1, max_concurrent_per_engine // sampling.n)
        self.queued: deque[PromptItem] = deque()
        self.in_flight: dict[str, tuple[int, PromptItem]] = {}  # request id -> (engine, item)
        self.load = [0] * len(engines)
        self.ids = itertools.count()

    def submit_ready(self, limit: float) -> None:
        """Submit queued prompts while an engine has capacity and fewer than `limit` are in flight."""
        calls = []
        while self.queued and len(self.in_flight) < limit:
            e = min(range(len(self.engines)), key=self.load.__getitem__)  # least-loaded engine first
            if self.load[e] >= self.capacity:
                break
            item = self.queued.popleft()
            rid = f"g{next(self.ids)}-p{item.index}"
            self.in_flight[rid] = (e, item)
            self.load[e] += 1
            calls.append(self.engines[e].submit.remote(rid, item.prompt, self.sampling, index=item.index))
        ray.get(calls)

    def poll(self, timeout: float) -> list[tuple[PromptItem, RolloutGroup]]:
        done = []
        busy = [e for e in range(len(self.engines)) if self.load[e]]
        for results in ray.get([self.engines[e].poll.remote(timeout=timeout) for e in busy]):
            for group in results:
                e, item = self.in_flight.pop(group.request_id)
                self.load[e] -= 1
                done.append((item, group))
        return done

    def abort_all(self) -> tuple[list[PromptItem], int]:
        """Abort what is in flight, wait for the aborted groups; returns their prompts and tokens."""
        by_engine: dict[int, list[str]] = {}
        for rid, (e, _) in self.in_flight.items():
            by_engine.setdefault(e, []).append(rid)
        ray.get([self.engines[e].abort.remote(rids) for e, rids in by_engine.items()])
        returned, tokens = [], 0
        while self.in_flight:
            for item, group in self.poll(timeout=0.5):
                returned.append(item)
                tokens += _tokens([group])
        return returned, tokens


def collect_early_stop(engines: list, dataset: PromptDataset, prompts: PromptSampler, sampler: DynamicSampler,
                       score: ScoreFn, sampling: Sampling, gen_batch_size: int,
                       max_concurrent_per_engine: int, poll_s: float = 0.05) -> Collected:
    """Stream prompts to the engines until train_batch_size groups are kept, then abort the rest."""
    run = _EarlyStop(engines, dataset, sampling, max_concurrent_per_engine)
    tokens = _Tokens()
    while not sampler.is_full:
        if not run.queued and not sampler.exhausted:
            run.queued.extend(dataset[i] for i in prompts.next(gen_batch_size))
            sampler.start_round()
        # No more in flight than the batch still needs at the keep rate seen so far: the rest
        # would mostly be aborted (waste) when the batch fills.
        run.submit_ready(sampler.groups_to_fill())
        if not run.in_flight:
            break  # round budget spent and everything came back: train on what was kept
        finished = run.poll(timeout=poll_s)
        if finished:
            items, groups = zip(*finished)
            tokens.add(sampler, score(items, groups))
    returned, tokens.aborted = run.abort_all()
    # Aborted prompts first, then the never-submitted ones, in their original order.
    prompts.push_back([it.index for it in returned] + [it.index for it in run.queued])
    result = _finish(sampler, tokens)
    result.metrics["sampling/aborted_groups"] = float(len(returned))
    return result


def groups_to_batch(groups: Sequence[Group[ScoredGroup]]) -> RolloutBatch:
    """Kept groups -> one RolloutBatch; `group` is the group's position in this step."""
    return RolloutBatch.from_samples([s for gid, g in enumerate(groups) for s in g.payload.samples(gid)])


class RewardScorer:
    """ScoreFn over the reward manager: decode responses, score them, group by prompt.

    The filter metric is `algorithm.filter_groups.metric`: `acc` uses correctness, the others the
    shaped score. Reward metrics of all calls in a step are averaged by `pop_metrics()`.
    """

    def __init__(self, reward, tokenizer, metric: str):
        self.reward, self.tokenizer, self.metric = reward, tokenizer, metric
        self._metrics: list[dict] = []
        self._sums = [0.0, 0.0, 0]  # score, acc, responses: the sampled reward before filtering

    def __call__(self, items: Sequence[PromptItem], groups: Sequence[RolloutGroup]) -> list[Group]:
        responses = [r for g in groups for r in g.responses]
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        per_response = [it for it, g in zip(items, groups) for _ in g.responses]
        out = self.reward(texts, [it.ground_truth for it in per_response], [len(r) for r in responses],
                          data_sources=[it.data_source for it in per_response],
                          extra_infos=[it.extra_info for it in per_response])
        self._metrics.append(out.metrics)
        self._sums = [self._sums[0] + out.score.sum().item(), self._sums[1] + out.acc.sum().item(),
                      self._sums[2] + len(responses)]
        kept, start = [], 0
        for item, group in zip(items, groups):
            sl = slice(start, start + len(group.responses))
            start = sl.stop
            values = out.acc[sl].float() if self.metric == "acc" else out.score[sl]
            kept.append(Group(values.tolist(), ScoredGroup(item, group, out.score[sl], out.acc[sl])))
        return kept

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
