"""The DAPO loop: generate -> reward -> dynamic sampling -> log-probs -> advantages -> update -> sync.

`run(cfg)` is what `python -m dapo_megatron.main` calls. The driver holds the config, the prompt
stream, counters and small per-step batches; the models live in the training ranks and engines.
"""
from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass, field

import ray

from dapo_megatron.algo import DynamicSampler, compute_grpo_advantages, masked_mean, rollout_logprob_metrics
from dapo_megatron.batch import unpad_positions
from dapo_megatron.config import DapoConfig
from dapo_megatron.data.sampler import PromptSampler
from dapo_megatron.driver import setup
from dapo_megatron.driver.collect import Collected, RewardScorer, collect_early_stop, collect_sync, groups_to_batch
from dapo_megatron.driver.metrics import MetricsLogger
from dapo_megatron.rollout.types import Sampling


MAX_EMPTY_STEPS = 3  # consecutive steps whose generation rounds kept no group before giving up


@dataclass
class Run:
    cfg: DapoConfig
    ctx: setup.Context  # datasets, tokenizer, placement, reward, checkpoints, output dir
    prompts: PromptSampler
    sampler: DynamicSampler
    scorer: RewardScorer
    logger: MetricsLogger
    step: int = 0
    syncs: int = 0
    stop_requested: bool = False
    timing: dict = field(default_factory=dict)

    @contextlib.contextmanager
    def timed(self, name: str):
        t0 = time.perf_counter()
        yield
        self.timing[f"timing/{name}"] = time.perf_counter() - t0


def generate(run: Run) -> Collected:
    cfg, ctx = run.cfg, run.ctx
    sampling = Sampling.from_config(cfg.rollout, cfg.data.max_response_length, seed=cfg.rollout.seed + run.step)
    sampling = Sampling(**{**vars(sampling), "stop_token_ids": ctx.stop_token_ids})
    args = (ctx.engines, ctx.train_data, run.prompts, run.sampler, run.scorer, sampling, cfg.data.gen_batch_size)
    if cfg.algorithm.filter_groups.mode == "early_stop":
        return collect_early_stop(*args, max_concurrent_per_engine=cfg.rollout.max_concurrent_per_engine)
    return collect_sync(*args)


def train_step(run: Run) -> dict:
    """One DAPO step; returns its metrics (empty if dynamic sampling kept nothing)."""
    cfg, ctx = run.cfg, run.ctx
    with run.timed("gen"):
        collected = setup.as_role("rollout engine", generate, run)
    if not collected.groups:
        return {}
    batch = groups_to_batch(collected.groups)
    mask = batch.loss_mask  # [B, T]
    with run.timed("old_logprob"):
        columns, route_metrics = ctx.train.compute_logprobs(ray.put(batch))
    batch.old_logprobs = columns["logprobs"]
    if "routed_experts" in columns:  # actor.router_replay=actor: the update replays these
        batch.routed_experts = unpad_positions(columns["routed_experts"], batch.sequence_lengths)
    if cfg.actor.use_kl_loss:
        with run.timed("ref"):
            batch.ref_logprobs = ctx.train.compute_ref_logprobs(ray.put(batch))
    # [B]: one advantage per response, every token's (the loss broadcasts it over T)
    batch.advantages = compute_grpo_advantages(batch.scores, batch.group,
                                               norm_by_std=cfg.algorithm.norm_adv_by_std_in_grpo)
    with run.timed("update"):
        metrics = ctx.train.update(ray.put(batch))
    with run.timed("sync"):
        run.syncs += 1
        metrics.update(setup.sync_weights(ctx.train, ctx.engines, cfg.rollout.sync,
                                          verify=setup.verify_due(cfg, run.syncs)))
    metrics.update(collected.metrics, **run.scorer.pop_metrics(), **route_metrics)
    metrics.update(rollout_logprob_metrics(batch.rollout_logprobs, batch.old_logprobs, mask))
    metrics.update({"reward/kept_mean": batch.scores.mean().item(), "acc/kept_mean": batch.acc.float().mean().item(),
                    "response_length/mean": batch.response_lengths.float().mean().item(),
                    "advantages/abs_mean": masked_mean(batch.advantages.abs()[:, None].expand_as(mask), mask).item(),
                    "driver/batch_bytes": batch.nbytes})
    return metrics


def run(cfg: DapoConfig) -> int:
    ctx = setup.prepare(cfg)
    run_ = Run(cfg, ctx, PromptSampler(len(ctx.train_data), shuffle=cfg.data.shuffle, seed=cfg.data.seed),
               DynamicSampler(cfg.data.train_batch_size, cfg.algorithm.filter_groups.max_num_gen_batches,
                              cfg.algorithm.filter_groups.on_exhausted, cfg.algorithm.filter_groups.enable),
               RewardScorer(ctx.reward, ctx.tokenizer, cfg.algorithm.filter_groups.metric),
               MetricsLogger(ctx.out_dir, cfg.trainer.logger, project=cfg.trainer.project_name,
                             experiment=cfg.trainer.experiment_name))
    signal.signal(signal.SIGTERM, lambda *_: setattr(run_, "stop_requested", True))
    setup.resume(run_)
    if cfg.trainer.val_before_train and run_.step == 0:
        run_.logger.log(0, setup.evaluate(run_))
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
        # driver/cpu_s: CPU the driver process itself burned (scoring glue, batching, logging),
        # as opposed to waiting for the engines and training ranks.
        metrics.update(run_.timing, **{"timing/step": time.perf_counter() - t0,
                                       "driver/cpu_s": time.process_time() - cpu0})
        if cfg.trainer.test_freq > 0 and run_.step % cfg.trainer.test_freq == 0:
            metrics.update(setup.evaluate(run_))
        run_.logger.log(run_.step, metrics)
        if cfg.trainer.save_freq > 0 and run_.step % cfg.trainer.save_freq == 0:
            setup.save(run_)
    if not (cfg.trainer.save_freq > 0 and run_.step % cfg.trainer.save_freq == 0):
        setup.save(run_)  # the end of the run, or SIGTERM: keep what was trained
    setup.shutdown(run_)
    return 0
