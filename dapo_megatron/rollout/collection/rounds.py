"""Recipe rounds (algorithm.filter_groups.mode=sync, the DAPO recipe): data.gen_batch_size prompts
are generated whole on all engines, scored and filtered, round after round, until
train_batch_size groups are kept (or max_num_gen_batches rounds ran)."""
from __future__ import annotations

import ray

from dapo_megatron.data.dataset import PromptItem
from dapo_megatron.rollout.collection.base import Collected, Source, Store, Tokens, finish, received
from dapo_megatron.rollout.health import EngineHealth
from dapo_megatron.rollout.types import Sampling


def _split(items: list, parts: int) -> list[list]:
    return [items[i::parts] for i in range(parts)]


class Rounds:
    """Recipe rounds: shard i of each round on engine i; nothing is in flight between steps."""

    def __init__(self, source: Source):
        self.source = source

    def collect(self, step: int, sampling: Sampling, store: Store) -> Collected:
        s, tokens = self.source, Tokens(store)
        while not s.sampler.should_stop():
            items = [s.dataset[i] for i in s.prompts.next(s.gen_batch_size)]
            shards = _split(items, len(s.engines))
            for shard, results in zip(shards, generate_round(s.engines, s.health, shards, sampling, store.partition)):
                tokens.driver_bytes += received(results)
                if shard:
                    tokens.add(s.sampler, s.score(shard, results))
            s.sampler.start_round()
            store.between()
        return finish(s.sampler, tokens)

    def in_flight(self) -> list[PromptItem]:
        return []


def generate_round(engines: list, health: EngineHealth | None, shards: list[list[PromptItem]],
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
