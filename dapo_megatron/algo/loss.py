"""Policy losses as a table (DAPO, GSPO, GSPO-token, CISPO, REINFORCE), rollout correction, loss aggregation.

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

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from dapo_megatron.algo.correction import Correction, rollout_correction

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


def _dapo(log_ratio, logprobs, advantages, mask, low, high, clip_c):
    """Token ratio r = pi / pi_old: max(-A r, -A clamp(r, 1 - low, 1 + high)), and for A < 0 the
    dual clip's bound -A * clip_c."""
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))  # [B, T]
    losses, metrics = _clipped(ratio, advantages, mask, low, high)
    if clip_c is not None:
        bound = -advantages * clip_c  # [B, T] or [B, 1]: only binds for A < 0
        dual_hit = (advantages < 0) & (bound < losses)
        losses = torch.where(dual_hit, bound, losses)
        metrics["pg_clipfrac_dual"] = masked_mean(dual_hit.float(), mask)
    return losses, metrics


def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean_t log(pi / pi_old) over each sequence's tokens: [B, 1] (0 for an empty row)."""
    return log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


def _gspo(log_ratio, logprobs, advantages, mask, low, high, clip_c):
    """GSPO: one ratio per sequence, s = exp(mean_t log r), clipped per sequence; every token of
    the sequence carries the sequence's loss, so seq-mean-token-mean averages sequences."""
    s = torch.exp(_sequence_log_ratio(log_ratio, mask).clamp(-20.0, 20.0)).expand_as(log_ratio)  # [B, T]
    return _clipped(s, advantages, mask, low, high)


def _gspo_token(log_ratio, logprobs, advantages, mask, low, high, clip_c):
    """GSPO-token: s_t = sg[s] * pi_t / sg[pi_t]: the value of GSPO's sequence ratio with a
    per-token gradient, so per-token advantages and any aggregation apply."""
    seq = _sequence_log_ratio(log_ratio, mask).detach()
    tok = torch.where(mask, logprobs - logprobs.detach(), torch.zeros_like(logprobs))
    return _clipped(torch.exp((seq + tok).clamp(-20.0, 20.0)), advantages, mask, low, high)


def _cispo(log_ratio, logprobs, advantages, mask, low, high, clip_c):
    """CISPO: -sg[clamp(r, 1 - low, 1 + high)] * A * log pi. The weight is clipped, not the
    update: every token, clipped or not, keeps its gradient through log pi."""
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    weight = ratio.clamp(1.0 - low, 1.0 + high).detach()
    lp = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    metrics = {"pg_clipfrac": masked_mean((ratio > 1.0 + high).float(), mask),
               "pg_clipfrac_lower": masked_mean((ratio < 1.0 - low).float(), mask),
               "pg_clipfrac_dual": torch.zeros((), device=ratio.device)}
    return -advantages * weight * lp, metrics


def _reinforce(log_ratio, logprobs, advantages, mask, low, high, clip_c):
    """REINFORCE: -A * log pi, no ratio and no clip (verl's bypass-mode loss_type=reinforce). Its
    importance weight pi / pi_rollout is the row's correction, taken against the current policy."""
    lp = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    zero = torch.zeros((), device=logprobs.device)
    return -advantages * lp, {"pg_clipfrac": zero, "pg_clipfrac_lower": zero, "pg_clipfrac_dual": zero}


def _clipped(ratio, advantages, mask, low, high):
    """max(-A r, -A clamp(r, 1 - low, 1 + high)) and which clip was active."""
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)  # [B, T]
    clip_hit = clipped > unclipped  # the clamp moved r the pessimistic way
    metrics = {"pg_clipfrac": masked_mean((clip_hit & (advantages > 0)).float(), mask),
               "pg_clipfrac_lower": masked_mean((clip_hit & (advantages < 0)).float(), mask),
               "pg_clipfrac_dual": torch.zeros((), device=ratio.device)}
    return torch.maximum(unclipped, clipped), metrics


@dataclass(frozen=True)
class PolicyLoss:
    per_token: Callable  # (log_ratio, logprobs, advantages, mask, low, high, clip_c) -> ([B, T] losses, metrics)
    agg: Optional[str]  # the actor.loss_agg_mode the objective is defined with (None: any)
    # The rollout correction's rho is pi / pi_rollout with pi the policy being trained (detached),
    # not pi_old: a loss with no ratio of its own takes the importance weight there.
    weighs_current: bool = False


# actor.policy_loss -> its row. The clip ratios are actor.clip_ratio_low / _high in every row
# (GSPO's paper uses ~3e-4 / 4e-4 on its sequence ratio); the dual clip (clip_ratio_c) is DAPO's.
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "dapo": PolicyLoss(_dapo, None),
    "gspo": PolicyLoss(_gspo, "seq-mean-token-mean"),
    "gspo_token": PolicyLoss(_gspo_token, None),
    "cispo": PolicyLoss(_cispo, None),
    "reinforce": PolicyLoss(_reinforce, None, weighs_current=True),
}


def compute_policy_loss(old_logprobs: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor,
                        loss_mask: torch.Tensor, *, clip_ratio_low: float, clip_ratio_high: float,
                        clip_ratio_c: Optional[float] = None, loss_agg_mode: str = "token-mean",
                        policy_loss: str = "dapo", rollout_logprobs: Optional[torch.Tensor] = None,
                        correction: Optional[Correction] = None,
                        global_token_count: Optional[Count] = None,
                        global_seq_count: Optional[Count] = None) -> tuple[torch.Tensor, dict]:
    """The policy loss `policy_loss` (POLICY_LOSSES). Inputs [B, T]; advantages [B, T] or [B].

    With `correction` (algo/correction.py) each token's loss is multiplied by its rollout
    correction factor: an importance weight exp(old - rollout) (truncated or banded; REINFORCE:
    exp(logprobs - rollout), detached), 0 where masked or rejected.

    Metrics (detached 0-d tensors; fractions are masked means over this batch's tokens):
      pg_loss            the returned loss (this micro-batch's share under global counts)
      pg_clipfrac        upper clip active (A > 0 and r > 1 + clip_ratio_high: gradient 0; CISPO: weight clipped)
      pg_clipfrac_lower  lower clip active
      pg_clipfrac_dual   dual clip active: A < 0 and the loss is bounded by -A * clip_ratio_c (dapo)
      ppo_kl             mean of old_logprobs - logprobs
      is_weight_mean, is_masked_frac, is_clipfrac, rejected_frac   (with a correction; algo/correction.py)
    """
    if policy_loss not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {policy_loss!r}; set actor.policy_loss to one of "
                         f"{', '.join(POLICY_LOSSES)}")
    row = POLICY_LOSSES[policy_loss]
    if row.agg is not None and loss_agg_mode != row.agg:
        raise ValueError(f"actor.policy_loss={policy_loss} is a sequence-level objective: it needs "
                         f"actor.loss_agg_mode={row.agg}, got {loss_agg_mode}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (or None to turn dual clip off), got {clip_ratio_c}; "
                         "set actor.clip_ratio_c")
    mask = loss_mask.bool()  # [B, T]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # [B, 1]
    # Zero the log-ratio on padding so exp() cannot overflow there; clamp like verl for the same reason.
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))  # [B, T]
    pg_losses, metrics = row.per_token(log_ratio, logprobs, advantages, mask, clip_ratio_low, clip_ratio_high,
                                       clip_ratio_c)
    if correction is not None and correction.active:
        anchor = logprobs.detach() if row.weighs_current else old_logprobs
        factor, extra = rollout_correction(anchor, rollout_logprobs, mask, correction)
        pg_losses = pg_losses * factor
        metrics.update(extra)
    loss = agg_loss(pg_losses, loss_mask, loss_agg_mode,
                    global_token_count=global_token_count, global_seq_count=global_seq_count)
    metrics["pg_loss"] = loss
    metrics["ppo_kl"] = masked_mean(-log_ratio, mask)
    return loss, {k: v.detach() for k, v in metrics.items()}
