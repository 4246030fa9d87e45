"""Batch reward for the trainer: score every response, add DAPO's overlong shaping, report metrics.

Config -> branch: `reward.custom_fn` set -> that function, called in-process like verl's
`compute_score`; else `reward.service_url` set -> the HTTP service; else a local `RewardPool`
(`reward.num_workers`, `reward.timeout_s`). The service and the pool score each row by its
data_source's scorer (reward/scorers.py: geo3k, else math). `reward.overlong_buffer.enable` ->
score += penalty.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from dapo_megatron.algo.shaping import overlong_penalty
from dapo_megatron.config.custom_fn import load_custom_fn
from dapo_megatron.config.schema import RewardConfig
from dapo_megatron.config.validate import check_reward
from dapo_megatron.reward.client import RewardClient
from dapo_megatron.reward.math_score import ERROR, NO_ANSWER, TIMEOUT, WORKER_DIED, RewardResult
from dapo_megatron.reward.pool import RewardPool

# Reasons that mean "math-verify never saw it because a safety cap refused it".
_REFUSED = ("too_long", "too_deep", "huge_power")


@dataclass
class RewardOutput:
    score: torch.Tensor  # [B] float32: math +1/-1, geo3k 0..1 (or the custom score) + overlong_penalty
    acc: torch.Tensor  # [B] bool: the dynamic-sampling filter metric
    pred: list[str]  # [B] extracted answers ("" when none)
    overlong_penalty: torch.Tensor  # [B] float32, <= 0; all 0 when the buffer is disabled
    reason: list[str]  # [B] why a pair scored -1 without a verdict ("" otherwise)
    metrics: dict[str, float]  # "reward/..." scalars for the logger


def check_reward_config(cfg: RewardConfig) -> Callable | None:
    """The reward keys' rules (config/validate.py), and reward.custom_fn loaded (None when unset)."""
    check_reward(cfg)
    return load_custom_fn(cfg.custom_fn) if cfg.custom_fn else None


class RewardManager:
    """`manager(responses, ground_truths, response_lengths) -> RewardOutput`; close() when done."""

    def __init__(self, cfg: RewardConfig, max_response_length: int):
        self.custom_fn = check_reward_config(cfg)
        self.cfg = cfg
        self.max_response_length = max_response_length
        self.backend: RewardPool | RewardClient | None = None
        if self.custom_fn is None:
            self.backend = (RewardClient(cfg.service_url) if cfg.service_url
                            else RewardPool(cfg.num_workers, cfg.timeout_s))

    def __call__(self, responses: list[str], ground_truths: list[str],
                 response_lengths: Sequence[int] | torch.Tensor, data_sources: Sequence[str] | None = None,
                 extra_infos: Sequence[dict] | None = None) -> RewardOutput:
        t0 = time.perf_counter()
        batch = len(responses)
        lengths = torch.as_tensor(response_lengths).reshape(-1)  # [B]
        if len(ground_truths) != batch or lengths.numel() != batch:
            raise ValueError(f"reward: {batch} responses, {len(ground_truths)} ground truths, "
                             f"{lengths.numel()} response lengths; they must match")
        if self.custom_fn is not None:
            results = self._score_custom(responses, ground_truths, data_sources, extra_infos)
        else:
            results = self.backend.score_batch(responses, ground_truths, data_sources)
        base = torch.tensor([r.score for r in results], dtype=torch.float32)  # [B]
        penalty = torch.zeros(batch, dtype=torch.float32)  # [B]
        buf = self.cfg.overlong_buffer
        if buf.enable:
            penalty = overlong_penalty(lengths, self.max_response_length, buf.len, buf.penalty_factor)
        out = RewardOutput(score=base + penalty, acc=torch.tensor([r.acc for r in results], dtype=torch.bool),
                           pred=[r.pred for r in results], overlong_penalty=penalty,
                           reason=[r.reason for r in results], metrics={})
        out.metrics = self._metrics(out, results, time.perf_counter() - t0)
        return out

    def _score_custom(self, responses, ground_truths, data_sources, extra_infos) -> list[RewardResult]:
        """verl's contract: fn(data_source, solution_str, ground_truth, extra_info) -> float or
        {"score": float, "acc"?: bool, "pred"?: str}. Runs in this thread, with no deadline: the
        function owns its time bounds (math-verify's alarm works only in a main thread)."""
        results = []
        for i, (response, truth) in enumerate(zip(responses, ground_truths)):
            source = data_sources[i] if data_sources is not None else None
            extra = extra_infos[i] if extra_infos is not None else None
            t0 = time.perf_counter()
            value = self.custom_fn(source, response, truth, extra)
            results.append(self._custom_result(value, time.perf_counter() - t0))
        return results

    def _custom_result(self, value: Any, elapsed_s: float) -> RewardResult:
        if isinstance(value, dict):
            if "score" not in value:
                raise TypeError(f"reward.custom_fn ({self.cfg.custom_fn}) returned a dict without "
                                f"'score': keys {sorted(value)}")
            score = float(value["score"])
            acc = bool(value["acc"]) if "acc" in value else score > 0
            pred = str(value.get("pred", ""))
        elif isinstance(value, (int, float)):
            score, acc, pred = float(value), float(value) > 0, ""
        else:
            raise TypeError(f"reward.custom_fn ({self.cfg.custom_fn}) must return a float or a dict "
                            f"with 'score', got {type(value).__name__}")
        if not math.isfinite(score):
            raise ValueError(f"reward.custom_fn ({self.cfg.custom_fn}) returned score {score}")
        return RewardResult(score, acc, pred, "", elapsed_s)

    def _metrics(self, out: RewardOutput, results: list[RewardResult], elapsed_s: float) -> dict:
        batch = max(len(results), 1)
        reasons = out.reason
        metrics = {
            "reward/score_mean": out.score.mean().item() if results else 0.0,
            "reward/acc_mean": out.acc.float().mean().item() if results else 0.0,
            "reward/timeouts": float(reasons.count(TIMEOUT)),
            "reward/errors": float(reasons.count(WORKER_DIED) + reasons.count(ERROR)),
            "reward/no_answer_frac": reasons.count(NO_ANSWER) / batch,
            "reward/refused": float(sum(reasons.count(r) for r in _REFUSED)),
            "reward/overlong_penalty_mean": out.overlong_penalty.mean().item() if results else 0.0,
            "timing/reward": elapsed_s,
        }
        if self.cfg.overlong_buffer.log:
            metrics["reward/overlong_frac"] = (out.overlong_penalty < 0).float().mean().item() \
                if results else 0.0
        if isinstance(self.backend, RewardPool):
            metrics["reward/worker_restarts_total"] = float(self.backend.restarts)
        return metrics

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()

    def __enter__(self) -> "RewardManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
