"""Rollout correction: the engine sampled from pi_rollout, the trainer's anchor is pi_old.

Per token rho_t = pi_old / pi_rollout = exp(old_logprobs - rollout_logprobs). Two mechanisms, as
verl's `algorithm.rollout_correction` has them:

- importance weights (`is_level`), detached, multiplying each token's policy loss:
    token      w_t = rho_t
    sequence   w_i = prod_t rho_t           (broadcast over the sequence's tokens)
    geometric  w_i = exp(mean_t log rho_t)
  `is_mode=truncate` clamps w at `is_threshold` (TIS); `is_mode=mask` keeps w inside the band
  [is_threshold_lower, is_threshold] and zeroes the tokens / sequences outside it (IcePop).
- rejection (`rs`): a token or a whole sequence is dropped when a divergence of rho leaves its
  bound. Criteria are named <aggregation>_<estimator> (verl's names): token_ | seq_sum_ |
  seq_mean_ | seq_max_ over k1 = -log rho, k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho. k1 is
  bounded as a ratio, exp(-aggregate) in [rs_threshold_lower, rs_threshold]; k2 / k3 above.
  `veto_threshold`: a sequence with any rho_t below it is dropped.
Dropped tokens get weight 0 and stay in the loss's normaliser (it is the mini-batch's token count,
fixed before the update; verl removes them from it too).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

SAFETY = 20.0  # |log rho| bound before exp(): an engine / trainer gap never overflows a weight
IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask")


def _seq(agg: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A [B, T] value -> its per-sequence aggregate [B, 1] over the mask."""
    def reduce(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if agg == "token":
            return v
        if agg == "seq_max":
            return torch.where(mask, v, torch.full_like(v, -torch.inf)).amax(-1, keepdim=True)
        total = torch.where(mask, v, torch.zeros_like(v)).sum(-1, keepdim=True)
        return total / mask.sum(-1, keepdim=True).clamp(min=1) if agg == "seq_mean" else total
    return reduce


# estimator -> its per-token value from log rho
ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda lr: -lr,
    "k2": lambda lr: 0.5 * lr ** 2,
    "k3": lambda lr: torch.exp(lr) - 1.0 - lr,
}
AGGREGATIONS = ("token", "seq_sum", "seq_mean", "seq_max")
RS_CRITERIA = tuple(f"{a}_{k}" for a in AGGREGATIONS for k in ESTIMATORS if not (a == "seq_max" and k == "k1"))


@dataclass(frozen=True)
class Correction:
    """The settings `actor.rollout_correction` holds (config/schema.RolloutCorrectionConfig)."""
    is_level: Optional[str] = None
    is_mode: str = "truncate"
    is_threshold: float = 2.0
    is_threshold_lower: Optional[float] = None  # mask mode; None: 1 / is_threshold
    rs: Optional[str] = None
    rs_threshold: Optional[float] = None
    rs_threshold_lower: Optional[float] = None  # k1 only; None: 1 / rs_threshold
    veto_threshold: Optional[float] = None

    def __post_init__(self):
        if self.is_level is not None and self.is_level not in IS_LEVELS:  # the config's auto / none
            raise ValueError(f"actor.rollout_correction.is_level={self.is_level!r} is resolved by the config's "
                             f"validation (load_config); pass one of {', '.join(IS_LEVELS)} or None")

    @property
    def active(self) -> bool:
        return self.is_level is not None or self.rs is not None or self.veto_threshold is not None

    @property
    def is_lower(self) -> float:
        """The mask band's bottom (default: the reciprocal of its top)."""
        return self.is_threshold_lower if self.is_threshold_lower is not None else 1.0 / self.is_threshold

    @property
    def rs_lower(self) -> float:
        """A k1 criterion's lower ratio bound (default: the reciprocal of the upper one)."""
        return self.rs_threshold_lower if self.rs_threshold_lower is not None else 1.0 / self.rs_threshold

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The metrics `rollout_correction` reports with these settings."""
        return (("is_weight_mean", "is_masked_frac", "is_clipfrac") if self.is_level else ()) + (
            ("rejected_frac",) if self.rs or self.veto_threshold else ())


def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: Optional[torch.Tensor], mask: torch.Tensor,
                       c: Correction) -> tuple[torch.Tensor, dict]:
    """Per-token factors [B, T] (detached: IS weight, 0 where masked or rejected) and metrics
    (is_weight_mean; token fractions of this batch: is_masked_frac, is_clipfrac the weights
    truncated at is_threshold, rejected_frac)."""
    if rollout_logprobs is None:
        raise ValueError("actor.rollout_correction needs the engine's log-probs (rollout_logprobs) and got none")
    mask = mask.bool()
    with torch.no_grad():
        log_rho = torch.where(mask, old_logprobs - rollout_logprobs, torch.zeros_like(old_logprobs))  # [B, T]
        safe = log_rho.clamp(-SAFETY, SAFETY)
        metrics = {}
        factor = torch.ones_like(log_rho)
        if c.is_level is not None:
            agg = {"token": "token", "sequence": "seq_sum", "geometric": "seq_mean"}[c.is_level]
            w = torch.exp(_seq(agg)(safe, mask).clamp(-SAFETY, SAFETY)).expand_as(log_rho)
            if c.is_mode == "truncate":
                clipped = w > c.is_threshold  # [B, T]: the weights the clamp lowers
                w = w.clamp(max=c.is_threshold)
                out_of_band = torch.zeros_like(mask)
            else:
                clipped = torch.zeros_like(mask)
                out_of_band = (w < c.is_lower) | (w > c.is_threshold)
            factor = torch.where(out_of_band, torch.zeros_like(w), w)
            metrics["is_weight_mean"] = _mean(factor, mask & ~out_of_band)
            metrics["is_masked_frac"] = _mean(out_of_band.float(), mask)
            metrics["is_clipfrac"] = _mean(clipped.float(), mask)
        rejected = torch.zeros_like(mask)
        if c.rs is not None:
            agg, est = c.rs.rsplit("_", 1)
            value = _seq(agg)(ESTIMATORS[est](safe), mask).expand_as(log_rho)
            if est == "k1":  # a bound on the ratio exp(-aggregate) = the (geometric mean / product of) rho
                ratio = torch.exp((-value).clamp(-SAFETY, SAFETY))
                rejected |= (ratio < c.rs_lower) | (ratio > c.rs_threshold)
            else:
                rejected |= value > c.rs_threshold
        if c.veto_threshold is not None:
            worst = torch.where(mask, safe, torch.full_like(safe, torch.inf)).amin(-1, keepdim=True)  # [B, 1]
            rejected |= (worst < torch.log(torch.tensor(c.veto_threshold))).expand_as(mask)
        if c.rs is not None or c.veto_threshold is not None:
            metrics["rejected_frac"] = _mean(rejected.float(), mask)
        factor = torch.where(rejected, torch.zeros_like(factor), factor)
    return factor, metrics


def _mean(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, v, torch.zeros_like(v)).sum() / mask.sum().clamp(min=1)
