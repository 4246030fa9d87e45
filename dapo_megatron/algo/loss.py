"""DAPO policy loss: clip-higher, dual clip, truncated importance sampling, loss aggregation.

Shapes: B sequences (responses) by T response tokens. `loss_mask` is 0/1 (bool or numeric); masked
positions may hold garbage (padding, -inf) and never reach the loss or its gradient.

Micro-batching contract. The trainer splits a mini-batch over DP ranks and micro-batches. It calls
`loss_normalizer_counts` on the whole mini-batch's mask (all ranks: sum the counts over DP) and
passes them as `global_token_count` / `global_seq_count`. Each micro-batch loss is then
sum / global_count, so the micro-batch losses (and their gradients) add up to the full-batch loss.
Gradients must be reduced by SUM over DP; a DDP that averages (Megatron's default) needs the loss
multiplied by the DP size.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

Count = Union[int, torch.Tensor]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is set; 0 (not NaN) when the mask is empty. Returns a 0-d tensor."""
    mask = mask.bool()
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp(min=1)


def loss_normalizer_counts(loss_mask: torch.Tensor) -> tuple[int, int]:
    """(tokens, seqs) of a mini-batch: the denominators `agg_loss` uses when given no global counts.

    tokens = unmasked tokens; seqs = rows, empty rows included (they add 0 to every seq-mean).
    Sum both over DP ranks before passing them as global_token_count / global_seq_count.
    """
    return int(loss_mask.bool().sum()), int(loss_mask.shape[0])


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, *,
             global_token_count: Optional[Count] = None,
             global_seq_count: Optional[Count] = None) -> torch.Tensor:
    """Aggregate a per-token loss [B, T] into a scalar.

    token-mean:              sum of unmasked tokens / token count
    seq-mean-token-sum:      mean over rows of (row token sum)
    seq-mean-token-mean:     mean over rows of (row token mean); an empty row counts as 0
    seq-mean-token-sum-norm: sum of unmasked tokens / (B * T), T = loss_mask.shape[-1] (Dr. GRPO).
                             T must be the same in every micro-batch (pad to max_response_length).
    token-mean uses global_token_count as its count, seq-* use global_seq_count as B; the other one
    is ignored. Without them the counts come from this batch (`loss_normalizer_counts`).
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; set actor.loss_agg_mode to one of "
                         f"{', '.join(LOSS_AGG_MODES)}")
    mask = loss_mask.bool()  # [B, T]
    # where, not multiply: 0 * inf/NaN in padding would poison the sum.
    masked = torch.where(mask, loss_mat, torch.zeros_like(loss_mat))  # [B, T]
    if loss_agg_mode == "token-mean":
        count = mask.sum() if global_token_count is None else global_token_count
        return masked.sum() / torch.as_tensor(count, device=masked.device).clamp(min=1)
    seq_sums = masked.sum(dim=-1)  # [B]
    if loss_agg_mode == "seq-mean-token-mean":
        seq_sums = seq_sums / mask.sum(dim=-1).clamp(min=1)
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_sums = seq_sums / loss_mask.shape[-1]
    count = loss_mask.shape[0] if global_seq_count is None else global_seq_count
    return seq_sums.sum() / torch.as_tensor(count, device=masked.device).clamp(min=1)


def compute_policy_loss(old_logprobs: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor,
                        loss_mask: torch.Tensor, *, clip_ratio_low: float, clip_ratio_high: float,
                        clip_ratio_c: Optional[float] = None, loss_agg_mode: str = "token-mean",
                        rollout_logprobs: Optional[torch.Tensor] = None, tis_cap: Optional[float] = None,
                        global_token_count: Optional[Count] = None,
                        global_seq_count: Optional[Count] = None) -> tuple[torch.Tensor, dict]:
    """DAPO clipped surrogate loss. Inputs [B, T]; advantages [B, T] or [B] (broadcast over T).

    ratio r = exp(logprobs - old_logprobs); per token: max(-A*r, -A*clamp(r, 1-low, 1+high));
    with clip_ratio_c, tokens with A < 0 are further bounded by -A*clip_ratio_c (dual clip).
    With tis_cap, each token is weighted by min(exp(old_logprobs - rollout_logprobs), tis_cap),
    detached: truncated importance sampling for the rollout engine / trainer mismatch.

    Metrics (detached 0-d tensors; fractions are masked means over this batch's tokens):
      pg_loss            the returned loss (this micro-batch's share under global counts)
      pg_clipfrac        upper clip active: A > 0 and r > 1 + clip_ratio_high (gradient 0)
      pg_clipfrac_lower  lower clip active: A < 0 and r < 1 - clip_ratio_low (gradient 0)
      pg_clipfrac_dual   dual clip active: A < 0 and the loss is bounded by -A * clip_ratio_c
      ppo_kl             mean of old_logprobs - logprobs
      tis_weight_mean, tis_clipfrac   (only with tis_cap) mean weight, fraction capped
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (or None to turn dual clip off), got {clip_ratio_c}; "
                         "set actor.clip_ratio_c")
    mask = loss_mask.bool()  # [B, T]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # [B, 1]
    # Zero the log-ratio on padding so exp() cannot overflow there; clamp like verl for the same reason.
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))  # [B, T]
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))  # [B, T]
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # [B, T]
    pg_losses = torch.maximum(unclipped, clipped)  # [B, T]
    clip_hit = clipped > unclipped  # the clamp moved r the pessimistic way: [B, T]
    metrics = {
        "pg_clipfrac": masked_mean((clip_hit & (advantages > 0)).float(), mask),
        "pg_clipfrac_lower": masked_mean((clip_hit & (advantages < 0)).float(), mask),
        "pg_clipfrac_dual": torch.zeros((), device=ratio.device),
    }
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c  # [B, T] or [B, 1]: only binds for A < 0
        dual_hit = (advantages < 0) & (bound < pg_losses)
        pg_losses = torch.where(dual_hit, bound, pg_losses)
        metrics["pg_clipfrac_dual"] = masked_mean(dual_hit.float(), mask)
    if tis_cap is not None:
        pg_losses = pg_losses * _tis_weights(old_logprobs, rollout_logprobs, mask, tis_cap, metrics)
    loss = agg_loss(pg_losses, loss_mask, loss_agg_mode,
                    global_token_count=global_token_count, global_seq_count=global_seq_count)
    metrics["pg_loss"] = loss
    metrics["ppo_kl"] = masked_mean(-log_ratio, mask)
    return loss, {k: v.detach() for k, v in metrics.items()}


def _tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: Optional[torch.Tensor], mask: torch.Tensor,
                 tis_cap: float, metrics: dict) -> torch.Tensor:
    """min(exp(old - rollout), cap), detached [B, T]; records tis_weight_mean and tis_clipfrac."""
    if tis_cap <= 0:
        raise ValueError(f"tis_cap must be > 0 (or None to turn TIS off), got {tis_cap}; set actor.tis_cap")
    if rollout_logprobs is None:
        raise ValueError("tis_cap is set but no rollout_logprobs were given; the rollout engine must return "
                         "log-probs, or set actor.tis_cap=null")
    with torch.no_grad():
        log_w = torch.where(mask, old_logprobs - rollout_logprobs, torch.zeros_like(old_logprobs))
        raw = torch.exp(log_w.clamp(max=20.0))  # [B, T]
        weights = raw.clamp(max=tis_cap)
        metrics["tis_weight_mean"] = masked_mean(weights, mask)
        metrics["tis_clipfrac"] = masked_mean((raw > tis_cap).float(), mask)
    return weights
