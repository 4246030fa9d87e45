"""The rollout manager: the producer side of the loop, one Ray actor.

It owns the prompt stream, the engines' submission / poll / abort, the reward worker (in this
process), dynamic sampling (a collection strategy, rollout/collection/), validation and the data
plane's start and stop, and hands the trainer a finished
`StepBatch` (keys + metadata; the tokens are in the data plane) per `next_batch` call. In the
synchronous loop the trainer asks for each batch after its weight push, so generation and training
take turns as the DAPO recipe does; with trainer.mode=one_step_off / async it asks for the next
trainer.batches_ahead batches before it trains on this one: they queue here and are collected one
after the other while the trainer trains (the driver's asking bounds how far ahead they run).
Its state (prompt position, sampler counters) goes into every checkpoint through the driver.
With rollout.max_engine_restarts it also keeps the engines' health (rollout/health.py): a dead
engine's prompts are generated again and the driver brings its replacement.
"""
from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import math
import threading
import time
from typing import Optional

import ray

from dapo_megatron import dataplane, heap, hooks
from dapo_megatron.algo import DynamicSampler
from dapo_megatron.config import DapoConfig
from dapo_megatron.data.dataset import PromptDataset
from dapo_megatron.data.sampler import PromptSampler
from dapo_megatron.dataplane import StepBatch
from dapo_megatron.logs import redirect_output
from dapo_megatron.reward.metrics import validation_metrics
from dapo_megatron.roles import as_role, died
from dapo_megatron.rollout import collection
from dapo_megatron.rollout.collection import Collected, Source, Store, groups_to_batch
from dapo_megatron.rollout.health import Death, EngineHealth
from dapo_megatron.rollout.reward_worker import RewardScorer, RewardWorker
from dapo_megatron.rollout.types import Sampling


# Its own threads for the driver's long poll of dead engines and their replacement, and for the
# trainer's releases and checkpoint state, while a collection runs; every other method stays one
# at a time.
CONCURRENCY_GROUPS = {"health": 2, "control": 1}


class RolloutManager:
    """engines: engine actor handles; tokenizer_path: what the reward worker decodes with;
    data_plane: a `dataplane.Handle`; log_path: where this process's library output goes (the
    run's logs/ folder). `start_data_plane`: the manager starts the data plane (cfg.data_plane;
    in its own process in the lean layout, trainer.layout) and stops it at `shutdown`: the store
    of the rows it produces lives with it, and the driver never imports TransferQueue (its
    tensordict pulls in torch._dynamo: ~0.15 GB a process)."""

    @heap.start_up()  # the tokenizer, the data plane's client, the reward pool
    def __init__(self, cfg: DapoConfig, engines: list, tokenizer_path: str, data_plane: dataplane.Handle,
                 train_data: PromptDataset, val_data: Optional[PromptDataset], stop_token_ids: tuple[int, ...],
                 log_path: Optional[str] = None, start_data_plane: bool = False):
        redirect_output(log_path)
        self.owns_plane = start_data_plane
        # The tokenizer and the reward pool load while the data plane's processes start: the
        # manager is the last role ready in a quickstart's start-up (the clients attach lazily).
        plane_up = dataplane.start_in_background(cfg.data_plane, data_plane.host) if start_data_plane else None
        self.reward = RewardWorker(cfg, tokenizer_path, data_plane)
        scorer = RewardScorer(self.reward, cfg.algorithm.filter_groups.metric)
        self._start(cfg, engines, dataplane.connect(data_plane), scorer, train_data, val_data, stop_token_ids)
        if plane_up is not None:
            plane_up.result()  # what the start raised, raised here

    def _start(self, cfg: DapoConfig, engines: list, plane, scorer, train_data: PromptDataset,
               val_data: Optional[PromptDataset], stop_token_ids: tuple[int, ...]) -> None:
        """The stream's state: what bench/async_sim.py's manager (timed stand-ins for the data
        plane, the reward and the engines) shares with this one."""
        fg = cfg.algorithm.filter_groups
        self.cfg, self.engines, self.plane, self.scorer = cfg, engines, plane, scorer
        self.train_data, self.val_data, self.stop_token_ids = train_data, val_data, tuple(stop_token_ids)
        self.prompts = PromptSampler(len(train_data), shuffle=cfg.data.shuffle, seed=cfg.data.seed)
        self.sampler = DynamicSampler(cfg.data.train_batch_size, fg.max_num_gen_batches, fg.on_exhausted, fg.enable)
        self.collections = 0  # names each collection's data-plane partition
        rollout = cfg.rollout
        self.health = (EngineHealth(self.engines, rollout.max_engine_restarts, rollout.engine_timeout_s)
                       if rollout.max_engine_restarts or rollout.engine_timeout_s else None)
        # async partial rollouts: the strategy keeps the groups in flight when the last batch
        # filled for the next collection; a checkpoint returns their prompts to the stream (`_state`)
        self.source = Source(self.engines, train_data, self.prompts, self.sampler, scorer, cfg.data.gen_batch_size,
                             self.health)
        self.collection = collection.build(cfg, self.source)
        # step -> the state before its batch was collected: a checkpoint taken while that batch
        # waits untrained (trainer.mode=one_step_off / async) saves this one, so its prompts come back.
        self.before: dict[int, dict] = {}
        self.state_lock = threading.Lock()  # `before` and the stream's state, read by `state_dict`
        # The data-plane client is used by one thread at a time: the collecting one, or a release
        # while nothing collects; releases that come during a collection wait in `released`.
        self.plane_lock = threading.Lock()
        self.released: list[str] = []
        self.resident = 0  # bytes the data plane held at the last release
        self.last_end: Optional[float] = None  # when the last collection ended (engine idle since)
        # trainer.stream_minibatches: a step's collection runs on this thread while its mini-batches
        # are handed out (`next_batch`), from the kept groups it publishes between two polls
        self.collector = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="collect")
        self.streams: dict[int, concurrent.futures.Future] = {}
        self.published: dict[int, tuple[str, list]] = {}
        self.published_cond = threading.Condition()

    def _sampling(self, sampling: Sampling) -> Sampling:
        return dataclasses.replace(sampling, stop_token_ids=self.stop_token_ids)

    def next_batch(self, step: int, part: int = 0, parts: int = 1) -> tuple[Optional[StepBatch], dict, Optional[StepBatch]]:
        """Mini-batch `part` of the `parts` that training step `step`'s batch (1-based) is handed over
        in, the rollout metrics and the whole batch (the last part's call; {} and None before it).
        One part: the whole batch, collected in this call. More (trainer.stream_minibatches): part 0's
        call starts the collection on the collecting thread and each call returns once its groups are
        in (kept groups, in arrival order: the whole batch is their concatenation). No part (None)
        when dynamic sampling kept too few groups (none: the reward metrics then carry over to the
        next batch). The rows live in partition `step<step>-<n>`; the trainer clears it once consumed."""
        if parts == 1:
            groups, partition, metrics = self._collect_timed(step)
            batch = groups_to_batch(groups, partition) if groups else None
            return batch, metrics, batch
        if part == 0:  # the trainer asks every part at once, in order: a new step's part 0 comes last
            self.streams[step] = future = self.collector.submit(self._collect_timed, step, True)
            future.add_done_callback(lambda _: self._notify())
        future, size = self.streams[step], self.sampler.train_batch_size // parts
        lo, hi = part * size, (part + 1) * size
        with self.published_cond:
            while part < parts - 1 and not future.done():
                partition, groups = self.published.get(step, ("", []))
                if len(groups) >= hi:
                    return groups_to_batch(groups[lo:hi], partition), {}, None
                self.published_cond.wait(0.05)
        groups, partition, metrics = future.result()  # what the collection raised, raised here
        last = part == parts - 1
        if last:
            self.streams.pop(step)
            with self.published_cond:
                self.published.pop(step, None)
        batch = groups_to_batch(groups[lo:hi], partition) if groups[lo:hi] else None
        return batch, metrics if last else {}, groups_to_batch(groups, partition) if last and groups else None

    def _notify(self) -> None:
        with self.published_cond:
            self.published_cond.notify_all()

    def _publisher(self, step: int, partition: str):
        """A streamed collection's `Store.between` (its thread, between two polls): the groups kept
        so far, for the mini-batches waiting on them."""
        def between():
            self._release_deferred()
            with self.published_cond:
                self.published[step] = (partition, list(self.sampler.buffer))
                self.published_cond.notify_all()
        return between

    def _collect_timed(self, step: int, stream: bool = False) -> tuple[list, str, dict]:
        with self.plane_lock:
            self._release_deferred()
            t0 = time.monotonic()
            try:
                groups, partition, metrics = self._collect(step, stream)
            finally:
                self.last_end, idle = time.monotonic(), t0 - (self.last_end or t0)
            if metrics:  # engines idle: between collections (the trainer's work in sync mode)
                metrics["timing/engine_idle_frac"] = idle / max(idle + self.last_end - t0, 1e-9)
                # when its last group was in (wall clock): how long the streamed update overlapped it
                metrics["timing/collected_at"] = time.time()  # popped by the trainer
            return groups, partition, metrics

    def _collect(self, step: int, stream: bool = False) -> tuple[list, str, dict]:
        cfg = self.cfg
        with self.state_lock:
            self.before = {s: v for s, v in self.before.items() if s >= step - 1 - cfg.trainer.batches_ahead}
            self.before[step] = copy.deepcopy(self._state())
        self.collections += 1
        partition = f"step{step}-{self.collections}"
        store = Store(partition, self.plane, between=self._publisher(step, partition) if stream else self._release_deferred)
        sampling = self._sampling(Sampling.from_config(cfg.rollout, cfg.data.max_response_length,
                                                       seed=cfg.rollout.seed + step - 1))
        if cfg.trainer.deterministic and cfg.trainer.carries_in_flight:  # partial rollouts in segments
            sampling = dataclasses.replace(sampling, segment_tokens=cfg.trainer.segment_length(cfg.data.max_response_length),
                                           free_version=step - 1)
        try:
            with hooks.at("manager.collect", step=step, engines=self.engines):  # a test's faults
                collected = as_role("rollout engine", self.collection.collect, step, sampling, store)
            if self.health is not None:  # the batch goes back once every engine is replaced: the
                self.health.wait_alive(any_of=False)  # driver's next sync reaches them all
        except BaseException:
            store.clear()
            raise
        if not collected.groups:
            store.clear()
            return [], partition, {}
        return collected.groups, partition, self._metrics(collected)

    def _metrics(self, collected: Collected) -> dict:
        return {**collected.metrics, **self.scorer.pop_metrics(), "data/prompts_consumed": float(self.prompts.consumed)}

    def evaluate(self, step: int) -> dict:
        """rollout.val_kwargs answers on the validation set: val/acc overall and per source; with
        val_kwargs.n > 1 also mean@n, pass@k and maj@k (reward/metrics.validation_metrics)."""
        if self.val_data is None:
            return {}
        with self.plane_lock:
            return self._evaluate(step)

    def _evaluate(self, step: int) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        items = list(self.val_data.items)
        sampling = self._sampling(Sampling.validation(cfg.rollout, cfg.data.max_response_length, seed=cfg.rollout.seed))
        shards = [items[i::len(self.engines)] for i in range(len(self.engines))]
        store = Store(f"val{step}", self.plane)
        scorer = RewardScorer(self.reward, "acc", answers=sampling.n > 1)
        per_source: dict[str, list[float]] = {}
        prompts = []  # (data_source, answers, correct) per prompt: pass@k / maj@k at n > 1
        try:
            results = self._generate_shards(shards, sampling, store.partition)
            for shard, groups in zip(shards, results):
                for g in scorer(shard, groups) if shard else []:
                    p = g.payload
                    per_source.setdefault(p.item.data_source, []).extend(p.acc.float().tolist())
                    prompts.append((p.item.data_source, p.answers, p.acc.tolist()))
        finally:
            store.clear()
        values = [v for vs in per_source.values() for v in vs]
        acc = sum(values) / max(len(values), 1)
        # the standard error of val/acc as a mean of its answers: what tells a rise from noise
        out = {"val/acc": acc, "val/acc_se": math.sqrt(acc * (1 - acc) / max(len(values), 1)),
               "timing/val": time.perf_counter() - t0}
        out.update({f"val/acc/{src}": sum(vs) / len(vs) for src, vs in per_source.items()})
        if sampling.n > 1:
            out.update(validation_metrics(prompts, seed=cfg.rollout.seed))
        return out

    def _generate_shards(self, shards: list[list], sampling: Sampling, partition: str) -> list:
        """Each engine's shard of the validation prompts, all generating at once. With
        rollout.max_engine_restarts a shard whose engine died is generated again, whole, on its
        replacement (the driver starts it, as for a collection: `engine_deaths`)."""
        def generate(engine: int):
            return self.engines[engine].generate.remote([it.prompt for it in shards[engine]], sampling, partition)
        refs, out = [generate(i) for i in range(len(shards))], []
        for i, shard in enumerate(shards):
            while True:
                try:
                    out.append(ray.get(refs[i]))
                    break
                except ray.exceptions.RayActorError as exc:
                    if self.health is None:
                        raise died("rollout engine", exc) from None
                    self.health.report(i, exc, len(shard))  # raises when no restart is left
                    self.health.wait_alive(any_of=False)
                    refs[i] = generate(i)
        return out

    @ray.method(concurrency_group="health")
    def engine_deaths(self, timeout: float = 60.0) -> list[Death]:
        """The driver's long poll (rollout.max_engine_restarts): engines that died since the last call."""
        return self.health.wait_dead(timeout)

    @ray.method(concurrency_group="health")
    def replace_engine(self, engine: int, handle, count: bool = False) -> None:
        """A started replacement, holding the current weights, takes the dead engine's place;
        `count`: a death the manager did not see (in the weight sync) counts as a restart."""
        self.health.replace(engine, handle, count)

    @ray.method(concurrency_group="control")
    def data_plane_config(self):
        """The addresses of the data plane this process hosts (the lean layout): what a client
        in another process attaches with (dataplane.attach)."""
        return dataplane.hosted_config()

    @ray.method(concurrency_group="control")
    def pushed(self, version: int) -> None:
        """The driver pushed policy `version` into the engines: a collection bounding its stale
        share (trainer.stale_share) starts fresh groups from now on."""
        self.source.version = version

    @ray.method(concurrency_group="control")
    def waiting_for_push(self, step: int) -> bool:
        """trainer.deterministic with partial rollouts: step's collection can go no further under the
        weights the engines hold (each response at its segment's end or finished), so a push lands
        where it would in any run."""
        return self.source.held == (step, self.source.version)

    @ray.method(concurrency_group="control")
    def state_dict(self, before: Optional[int] = None) -> dict:
        """What a checkpoint needs to resume the stream exactly (the keys older checkpoints have);
        `before`: as it was before the batch of that step was collected (a batch not yet trained;
        one whose collection has not started yet: as it is now, no collection running)."""
        with self.state_lock:
            return self.before[before] if before in self.before else copy.deepcopy(self._state())

    def _state(self) -> dict:
        prompts = self.prompts
        carried = self.collection.in_flight()
        if carried:  # generated, not trained: a resume samples them again
            prompts = copy.deepcopy(prompts)
            prompts.push_back([item.index for item in carried])
        return {"prompts": prompts.state_dict(), "dynamic_sampling": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """The stream as `state` has it; the states kept for batches collected before it (a
        restart that kept this manager) no longer apply."""
        with self.state_lock:
            self.before.clear()
            self.prompts.load_state_dict(state["prompts"])
            self.sampler.load_state_dict(state["dynamic_sampling"])

    @ray.method(concurrency_group="control")
    def release(self, partition: str) -> int:
        """Drop a consumed (or failed) batch's rows; returns what the data plane still holds (bytes).
        While a collection runs the rows go between two of its polls, and the bytes are those of
        the last release done."""
        self.released.append(partition)
        if self.plane_lock.acquire(blocking=False):
            try:
                self._release_deferred()
            finally:
                self.plane_lock.release()
        return self.resident

    def _release_deferred(self) -> None:
        if self.released:
            while self.released:
                Store(self.released.pop(0), self.plane).clear()
            self.resident = self.plane.resident_bytes()

    def shutdown(self) -> None:
        """The reward worker's pool, every engine and the data plane it started, before Ray goes."""
        self.reward.close()
        self.collector.shutdown(wait=False, cancel_futures=True)
        ray.get([e.shutdown.remote() for e in self.engines])
        with self.plane_lock:
            self._release_deferred()
            if self.owns_plane:
                dataplane.stop()


def manager_actor():
    """The RolloutManager as a Ray actor class, with its concurrency groups."""
    return ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(RolloutManager)
