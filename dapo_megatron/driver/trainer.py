"""The trainer: one attempt's state, its steps and its moments as methods (driver/supervisor.py
starts it, and starts another when a role dies).

A step: take a batch -> advantages -> log-probs -> update -> sync -> log / save. The rollout
manager (rollout/manager.py) produces each batch (generation, reward, dynamic sampling); the
trainer holds the config, counters and each step's metadata (keys, lengths, scores, advantages:
`StepBatch`) and passes handles: the tokens go from the engines into the data plane, and the
training ranks read their share there. Start, resume, save and the end are the run's moments
(driver/moments.py); they and the sync take turns with the engines for the device (driver/colocate.py).
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from dapo_megatron import hooks, roles
from dapo_megatron.algo import compute_grpo_advantages
from dapo_megatron.config import DapoConfig
from dapo_megatron.driver import setup
from dapo_megatron.driver.colocate import TimeShare
from dapo_megatron.driver.batches import Batches
from dapo_megatron.driver.metrics import MetricsLogger, PhaseLog, batch_metrics, join_parts
from dapo_megatron.driver.moments import Moments
from dapo_megatron.driver.recovery import replace_lost_in_sync, replaces_in_sync, wait_manager
from dapo_megatron.driver.weight_sync import sync_weights, verify_due

MAX_EMPTY_STEPS = 3  # consecutive steps whose generation rounds kept no group before giving up


@dataclass
class Trainer(Moments, Batches):
    cfg: DapoConfig
    ctx: setup.Context  # the roles' handles (manager, ranks, engines), checkpoints, output dir
    logger: MetricsLogger
    share: TimeShare  # colocated placement: who holds the device memory in which phase
    phases: PhaseLog
    step: int = 0
    syncs: int = 0
    stop_requested: bool = False
    timing: dict = field(default_factory=dict)
    # one_step_off / async: the batches asked of the rollout manager beyond this step's, oldest first
    pending: deque = field(default_factory=deque)
    checkpoint: Optional[str] = None  # the newest this run saved or resumed from (a restart's)
    deaths: object = None  # the manager's long poll for dead engines (driver/recovery.py)
    engine_restarts: int = 0
    syncing: Optional[str] = None  # the weight sync under way (`in_sync`)
    stale_responses: int = 0  # trained so far that started before their step's last push (checkpointed)

    @contextlib.contextmanager
    def in_sync(self, what: str):
        """Around a weight sync (`what`: step, resume or replacement): a rank that dies inside one
        may leave roles that cannot be kept (`recovery.keep_roles`); left set when the sync raises."""
        self.syncing = what
        yield
        self.syncing = None

    @contextlib.contextmanager
    def timed(self, name: str, what=()):
        """A phase of the step: its seconds add up in timing/<name>, and it gets a line in phases.jsonl."""
        t0 = time.perf_counter()
        yield
        seconds = time.perf_counter() - t0
        self.timing[f"timing/{name}"] = self.timing.get(f"timing/{name}", 0.0) + seconds
        self.phases.write(self.step + 1, name, what, seconds)

    def train(self) -> int:
        """The attempt's steps, from its start (build, resume, first sync) to its last save."""
        cfg = self.cfg
        self.start()
        if cfg.trainer.val_before_train and self.step == 0:
            self.logger.log(0, self.evaluate())
        empty = 0
        while self.step < self.ctx.total_steps and not self.stop_requested:
            t0, cpu0 = time.perf_counter(), time.process_time()
            metrics = self.train_step()
            if not metrics:
                empty += 1
                if empty >= MAX_EMPTY_STEPS:
                    raise RuntimeError(
                        f"dynamic sampling kept no group in {empty} attempts at step {self.step + 1}: every group's "
                        f"algorithm.filter_groups.metric ({cfg.algorithm.filter_groups.metric}) is identical. Check "
                        "the reward, raise algorithm.filter_groups.max_num_gen_batches or set "
                        "algorithm.filter_groups.enable=false")
                print(f"step {self.step + 1}: dynamic sampling kept no group; generating again", flush=True)
                continue
            empty = 0
            self.step += 1
            # driver/cpu_s: CPU the driver process itself burned (advantages, metadata, logging), as
            # opposed to waiting for the rollout manager and the training ranks.
            metrics.update(self.timing, **{"timing/step": time.perf_counter() - t0,
                                           "driver/cpu_s": time.process_time() - cpu0})
            self.timing = {}
            metrics.update(self.ctx.train.pop_memory())  # memory/device_peak_gb/<phase>; none on a CPU
            if cfg.rollout.max_engine_restarts:
                metrics["rollout/engine_restarts"] = float(self.engine_restarts)  # in this run so far
            if cfg.trainer.test_freq > 0 and self.step % cfg.trainer.test_freq == 0:
                metrics.update(self.evaluate())
            self.logger.log(self.step, metrics)
            if cfg.trainer.save_freq > 0 and self.step % cfg.trainer.save_freq == 0:
                self.save()
        if not (cfg.trainer.save_freq > 0 and self.step % cfg.trainer.save_freq == 0):
            self.save()  # the end of the run, or SIGTERM: keep what was trained
        self.shutdown()
        return 0

    def train_step(self) -> dict:
        """One DAPO step; returns its metrics (empty if dynamic sampling kept nothing). The step's
        rows live in one data-plane partition, cleared when the update consumed them (or failed).
        Streamed (trainer.stream_minibatches), each mini-batch trains, one optimizer step, as soon
        as its groups are in, while the engines finish the others; the push after the last."""
        request = self.pending.popleft() if self.pending else self._request(self.step + 1)
        updates, logprobs, tokens, partition, batch, rollout_metrics = [], [], [], None, None, {}
        taken = 0
        try:
            for k, ref in enumerate(request.refs):
                part, rollout_metrics, batch = self.take_part(request, k)
                taken = k + 1
                if part is None:
                    continue
                if not updates:
                    self.share.to_training(self)  # engines sleep, the actor's state comes back
                    first_update = time.time()
                partition = part.partition
                update, lp_metrics = self.train_on(part, first=not updates)
                updates.append(update)
                logprobs.append(lp_metrics)
                tokens.append(sum(part.sequence_lengths))
        except Exception:
            if partition is not None and taken < len(request.refs):  # streamed: the collection still
                with contextlib.suppress(Exception):  # writes into the partition; it goes once done
                    wait_manager(self, request.last, get=False)
            raise
        finally:  # the step's rows, consumed (or failed); what the data plane still holds
            if partition is not None:
                resident = roles.get("rollout manager", self.ctx.manager.release.remote(partition))
        collected_at = rollout_metrics.pop("timing/collected_at", None)
        if batch is None:
            return {}
        metrics = join_parts(updates, tokens)
        if len(request.refs) > 1 and collected_at is not None:  # trained while the step's groups generated
            metrics["timing/stream_overlap"] = max(0.0, collected_at - first_update)
        metrics.update(self.sync())
        metrics.update(rollout_metrics, **join_parts(logprobs))
        if not batch.advantages:  # streamed: the whole batch's, for its metrics (a part's are its own)
            self._advantages(batch)
        metrics.update(batch_metrics(batch, metrics, resident))
        return metrics

    def train_on(self, batch, first: bool) -> tuple[dict, dict]:
        """Advantages, (old / ref log-probs) and the update of one part of the step's batch: its
        optimizer steps; `first`: the step's first part (the learning-rate schedule counts steps)."""
        cfg, train = self.cfg, self.ctx.train
        self._advantages(batch)
        lp_metrics = {}
        if cfg.actor.runs_old_logprob_pass(cfg.rollout.n, len(batch)):  # else the update's forward or the engine's
            with self.timed("old_logprob"):
                written, lp_metrics = train.step_logprobs(batch, "actor")
            batch.fields += tuple(written)  # old_logprobs, and the routes when the actor records them
        if cfg.actor.use_kl_loss:
            with self.timed("ref"):
                written, _ = train.step_logprobs(batch, "ref")
            batch.fields += tuple(written)
        with hooks.at("driver.update", step=self.step + 1, ctx=self.ctx), self.timed("update"):
            return train.step_update(batch, first=first), lp_metrics

    def _advantages(self, batch) -> None:
        """One advantage per response (the loss broadcasts it over T), normalised within its group:
        a mini-batch of whole groups gets the values the whole batch would."""
        batch.advantages = compute_grpo_advantages(torch.tensor(batch.scores), torch.tensor(batch.group),
                                                   norm_by_std=self.cfg.algorithm.norm_adv_by_std_in_grpo).tolist()

    def sync(self) -> dict:
        """The step's weights into the engines, once the batches in flight that must finish on
        the old ones have (unless they are carried); an engine lost in it is replaced after."""
        self.share.before_sync(self)
        t = self.cfg.trainer
        if self.pending and (t.deterministic or not t.carries_in_flight):
            with self.timed("sync_wait"):  # the batches in flight finish on the old weights (drain),
                self.wait_before_push()  # or reach the push's point in them (deterministic segments)
        lost = [] if replaces_in_sync(self.cfg) else None  # engines that die in the sync (the rest synced)
        with hooks.at("driver.sync", step=self.step + 1, ctx=self.ctx), self.timed("sync"), self.in_sync("step"):
            self.syncs += 1
            metrics = sync_weights(self.ctx.train, self.ctx.engines, self.cfg.rollout.sync, lost=lost,
                                   verify=verify_due(self.cfg, self.syncs), version=self.syncs)
        self.ctx.manager.pushed.remote(self.syncs)  # a collection holding prompts for it goes on
        replace_lost_in_sync(self, lost or [])  # before the time share wakes every engine's KV cache
        self.share.after_sync(self)
        return metrics

    def evaluate(self) -> dict:
        """The rollout manager's validation (rollout.val_kwargs): val/acc overall and per source; an
        engine that dies meanwhile is replaced (rollout.max_engine_restarts), as in a collection."""
        return wait_manager(self, self.ctx.manager.evaluate.remote(self.step))
