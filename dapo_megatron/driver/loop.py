"""The trainer loop: take a batch -> log-probs -> advantages -> update -> sync -> log / save.

`train(run)` takes the steps of one attempt of the run (driver/supervisor.py starts its roles and
restarts it). The rollout manager (rollout/manager.py)
produces each batch (generation, reward, dynamic sampling); the driver holds the config, counters
and each step's metadata (keys, lengths, scores, advantages: `StepBatch`) and passes handles: the
tokens go from the engines into the data plane, and the training ranks read their share there.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from dapo_megatron import roles
from dapo_megatron.algo import compute_grpo_advantages
from dapo_megatron.config import DapoConfig
from dapo_megatron.driver import faults, setup
from dapo_megatron.driver.colocate import TimeShare
from dapo_megatron.driver.metrics import MetricsLogger, PhaseLog
from dapo_megatron.driver.recovery import drop_pending, replace_lost_in_sync, replaces_in_sync, wait_manager


MAX_EMPTY_STEPS = 3  # consecutive steps whose generation rounds kept no group before giving up


@dataclass
class Run:
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


@dataclass(frozen=True)
class Request:
    """A batch asked of the rollout manager: its future and the step it is for."""
    ref: object
    step: int


def _request(run: Run, step: int) -> Request:
    return Request(run.ctx.manager.next_batch.remote(step), step)


def take_batch(run: Run) -> tuple:
    """This step's batch and its rollout metrics. sync: generated now, with the last step's
    weights. one_step_off / async: asked trainer.batches_ahead steps ago, generated while earlier
    steps trained; the batches of the next steps are asked before this one trains."""
    ahead = run.cfg.trainer.batches_ahead
    request = run.pending.popleft() if run.pending else _request(run, run.step + 1)
    with run.timed("trainer_wait" if ahead else "gen"):
        step, metrics = wait_manager(run, request.ref)
    asked = run.pending[-1].step if run.pending else request.step
    for s in range(asked + 1, min(run.step + 1 + ahead, run.ctx.total_steps) + 1):
        run.pending.append(_request(run, s))
    if step is not None:
        metrics.update(staleness(step.versions, run.syncs, ahead))
    return step, metrics


def staleness(versions: list[tuple[int, int]], syncs: int, bound: int) -> dict:
    """Per response, the pushes its oldest token lags the weights it trains (the engine records
    each token's policy version); a response sampled across a push is partial. A lag past
    `bound` cannot happen by construction (a batch is asked `bound` steps ahead at most): it is
    a bug in the version record, and training on it would break the staleness contract."""
    lags = [syncs - oldest for oldest, _ in versions]
    if max(lags) > bound or min(lags) < 0:
        raise RuntimeError(f"a response's policy lag {max(lags)} (oldest version {min(v for v, _ in versions)}, "
                           f"{syncs} weight pushes done) is outside [0, trainer.batches_ahead={bound}]")
    return {"rollout/staleness_mean": sum(lags) / len(lags), "rollout/staleness_max": float(max(lags)),
            "rollout/partial_frac": sum(a != b for a, b in versions) / len(versions)}


def evaluate(run: Run) -> dict:
    """The rollout manager's validation (rollout.val_kwargs): val/acc overall and per source; an
    engine that dies meanwhile is replaced (rollout.max_engine_restarts), as in a collection."""
    return wait_manager(run, run.ctx.manager.evaluate.remote(run.step))


def train_step(run: Run) -> dict:
    """One DAPO step; returns its metrics (empty if dynamic sampling kept nothing). The step's
    rows live in one data-plane partition, cleared when the update consumed them (or failed)."""
    cfg, ctx = run.cfg, run.ctx
    step, rollout_metrics = take_batch(run)
    if step is None:
        return {}
    try:
        run.share.to_training(run)  # engines sleep, the actor's state comes back
        # one advantage per response, every token's (the loss broadcasts it over T)
        step.advantages = compute_grpo_advantages(torch.tensor(step.scores), torch.tensor(step.group),
                                                  norm_by_std=cfg.algorithm.norm_adv_by_std_in_grpo).tolist()
        lp_metrics = {}
        if not cfg.actor.reuses_update_forward(cfg.rollout.n, len(step)):  # else the update's forward is it
            with run.timed("old_logprob"):
                written, lp_metrics = ctx.train.step_logprobs(step, "actor")
            step.fields += tuple(written)  # old_logprobs, and the routes when the actor records them
        if cfg.actor.use_kl_loss:
            with run.timed("ref"):
                written, _ = ctx.train.step_logprobs(step, "ref")
            step.fields += tuple(written)
        with faults.injected("update", run.step + 1, ctx), run.timed("update"):
            metrics = ctx.train.step_update(step)
    finally:  # the step's rows, consumed (or failed); what the data plane still holds
        resident = roles.get("rollout manager", ctx.manager.release.remote(step.partition))
    run.share.before_sync(run)
    if run.pending and not cfg.trainer.carries_in_flight:
        with run.timed("sync_wait"):  # the batches in flight finish on the old weights (drain)
            for request in run.pending:
                wait_manager(run, request.ref, get=False)
    lost = [] if replaces_in_sync(cfg) else None  # engines that die in the sync (the rest synced)
    with faults.injected("sync", run.step + 1, ctx), run.timed("sync"), run.in_sync("step"):
        run.syncs += 1
        metrics.update(setup.sync_weights(ctx.train, ctx.engines, cfg.rollout.sync, lost=lost,
                                          verify=setup.verify_due(cfg, run.syncs), version=run.syncs))
    replace_lost_in_sync(run, lost or [])  # before the time share wakes every engine's KV cache
    run.share.after_sync(run)
    metrics.update(rollout_metrics, **lp_metrics)
    metrics.update(_batch_metrics(step, metrics, resident))
    return metrics


def _batch_metrics(step, metrics: dict, resident_bytes: int) -> dict:
    """The kept batch's reward, length and advantage, from its metadata; the bytes the control
    plane (the rollout manager) received from the engines per scored response (`driver/*`: the
    names runs have always logged); what the data plane still holds once the step's partition
    is cleared (its baseline: 0)."""
    tokens = torch.tensor(step.loss_tokens, dtype=torch.float32)
    adv = torch.tensor(step.advantages).abs()
    received = metrics["driver/bytes"]
    return {"reward/kept_mean": sum(step.scores) / len(step), "acc/kept_mean": sum(step.acc) / len(step),
            "response_length/mean": sum(step.response_lengths) / len(step),
            "advantages/abs_mean": float((adv * tokens).sum() / tokens.sum().clamp(min=1)),
            "driver/bytes": received,
            "driver/bytes_per_response": received / max(metrics.get("sampling/scored_responses", 1.0), 1.0),
            "data_plane/resident_mb": resident_bytes / 2**20}


def train(run_: Run) -> int:
    """The run's steps, from its start (build, resume, first sync) to its last save."""
    cfg, ctx = run_.cfg, run_.ctx
    setup.start(run_)  # build, resume, first sync: in turns with the engines (driver/colocate.py)
    if cfg.trainer.val_before_train and run_.step == 0:
        run_.logger.log(0, evaluate(run_))
    empty = 0
    while run_.step < ctx.total_steps and not run_.stop_requested:
        t0, cpu0 = time.perf_counter(), time.process_time()
        metrics = train_step(run_)
        if not metrics:
            empty += 1
            if empty >= MAX_EMPTY_STEPS:
                raise RuntimeError(
                    f"dynamic sampling kept no group in {empty} attempts at step {run_.step + 1}: every group's "
                    f"algorithm.filter_groups.metric ({cfg.algorithm.filter_groups.metric}) is identical. Check "
                    "the reward, raise algorithm.filter_groups.max_num_gen_batches or set "
                    "algorithm.filter_groups.enable=false")
            print(f"step {run_.step + 1}: dynamic sampling kept no group; generating again", flush=True)
            continue
        empty = 0
        run_.step += 1
        # driver/cpu_s: CPU the driver process itself burned (advantages, metadata, logging), as
        # opposed to waiting for the rollout manager and the training ranks.
        metrics.update(run_.timing, **{"timing/step": time.perf_counter() - t0,
                                       "driver/cpu_s": time.process_time() - cpu0})
        run_.timing = {}
        metrics.update(ctx.train.pop_memory())  # memory/device_peak_gb/<phase>; none on a CPU
        if cfg.rollout.max_engine_restarts:
            metrics["rollout/engine_restarts"] = float(run_.engine_restarts)  # in this run so far
        if cfg.trainer.test_freq > 0 and run_.step % cfg.trainer.test_freq == 0:
            metrics.update(evaluate(run_))
        run_.logger.log(run_.step, metrics)
        if cfg.trainer.save_freq > 0 and run_.step % cfg.trainer.save_freq == 0:
            setup.save(run_)
    if not (cfg.trainer.save_freq > 0 and run_.step % cfg.trainer.save_freq == 0):
        setup.save(run_)  # the end of the run, or SIGTERM: keep what was trained
    drop_pending(run_)
    run_.phases.close()
    setup.shutdown(run_)
    return 0
