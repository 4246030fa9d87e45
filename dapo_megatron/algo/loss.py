"""Policy losses as a table (DAPO, GSPO, GSPO-token, CISPO, REINFORCE and verl's other registered
losses: SAPO, GMPO, Clip-Cov, KL-Cov, GPG, DRO, DPPO), rollout correction, loss aggregation.

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


@dataclass(frozen=True)
class LossParams:
    """The keys of the rows that have their own (actor.policy_loss_params; verl's names and defaults)."""
    tau_pos: float = 1.0  # sapo: the gate's temperature where A > 0
    tau_neg: float = 1.05  # sapo: where A <= 0
    clip_cov_ratio: float = 0.0002  # clip_cov: share of the tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: the covariance band those are drawn from
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: share of the tokens (largest covariance) given the KL term
    ppo_kl_coef: float = 0.1  # kl_cov: its coefficient
    dro_beta: Optional[float] = None  # dro: the quadratic log-ratio penalty (required there)

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


def _dapo(log_ratio, logprobs, advantages, mask, low, high, clip_c, params):
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


def _gspo(log_ratio, logprobs, advantages, mask, low, high, clip_c, params):
    """GSPO: one ratio per sequence, s = exp(mean_t log r), clipped per sequence; every token of
    the sequence carries the sequence's loss, so seq-mean-token-mean averages sequences."""
    s = torch.exp(_sequence_log_ratio(log_ratio, mask).clamp(-20.0, 20.0)).expand_as(log_ratio)  # [B, T]
    return _clipped(s, advantages, mask, low, high)


def _gspo_token(log_ratio, logprobs, advantages, mask, low, high, clip_c, params):
    """GSPO-token: s_t = sg[s] * pi_t / sg[pi_t]: the value of GSPO's sequence ratio with a
    per-token gradient, so per-token advantages and any aggregation apply."""
    seq = _sequence_log_ratio(log_ratio, mask).detach()
    tok = torch.where(mask, logprobs - logprobs.detach(), torch.zeros_like(logprobs))
    return _clipped(torch.exp((seq + tok).clamp(-20.0, 20.0)), advantages, mask, low, high)


def _cispo(log_ratio, logprobs, advantages, mask, low, high, clip_c, params):
    """CISPO: -sg[clamp(r, 1 - low, 1 + high)] * A * log pi. The weight is clipped, not the
    update: every token, clipped or not, keeps its gradient through log pi."""
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    weight = ratio.clamp(1.0 - low, 1.0 + high).detach()
    lp = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    metrics = {"pg_clipfrac": masked_mean((ratio > 1.0 + high).float(), mask),
               "pg_clipfrac_lower": masked_mean((ratio < 1.0 - low).float(), mask),
               "pg_clipfrac_dual": torch.zeros((), device=ratio.device)}
    return -advantages * weight * lp, metrics


def _zero_clips(like: torch.Tensor) -> dict:
    """The clip fractions of a row that has no such clip."""
    zero = torch.zeros((), device=like.device, dtype=like.dtype)
    return {"pg_clipfrac": zero, "pg_clipfrac_lower": zero, "pg_clipfrac_dual": zero}


def _reinforce(log_ratio, logprobs, advantages, mask, low, high, clip_c, params):
    """REINFORCE: -A * log pi, no ratio and no clip (verl's bypass-mode loss_type=reinforce). Its
    importance weight pi / pi_rollout is the row's correction, taken against the current policy."""
    lp = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    return -advantages * lp, _zero_clips(logprobs)


def _sapo(log_ratio, logprobs, advantages, mask, low, high, clip_c, params):
    """SAPO (arXiv 2511.20347): a soft gate instead of the hard clip, -A * f(r) with
    f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos where A > 0 else tau_neg; f'(1) = 1, so on
    policy it is the policy gradient, and the gradient fades smoothly as r leaves 1."""
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    tau = torch.where(advantages > 0, params.tau_pos, params.tau_neg).to(ratio.dtype)
    return -advantages * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau), _zero_clips(ratio)


def _masked_row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, 1]: each row's mean over its tokens (verl's sum / (count + 1e-8): 0 for an empty row)."""
    return torch.where(mask, values, torch.zeros_like(values)).sum(-1, keepdim=True) / (mask.sum(-1, keepdim=True) + 1e-8)


def _geo_mean(log_ratio, logprobs, advantages, mask, low, high, clip_c, params):
    """GMPO (arXiv 2507.20673): the geometric mean of the token ratios, each clipped in log space
    the pessimistic way for its advantage's sign: -A_seq * exp(mean_t sgn(A) min(sgn(A) log r,
    sgn(A) clamp(log r, -low, high))). One loss per sequence, on each of its tokens."""
    adv = advantages.expand_as(log_ratio)
    sgn = torch.sign(adv)
    clamped = log_ratio.clamp(-low, high)
    pessimistic = sgn * torch.minimum(sgn * log_ratio, sgn * clamped)
    seq = -_masked_row_mean(adv, mask) * torch.exp(_masked_row_mean(pessimistic, mask))  # [B, 1]
    clipped = (log_ratio != clamped).float()
    metrics = _zero_clips(adv)
    metrics.update(pg_clipfrac=masked_mean(clipped * (adv > 0), mask), pg_clipfrac_lower=masked_mean(clipped * (adv < 0), mask))
    return seq.expand_as(log_ratio), metrics


def _clip_cov(log_ratio, logprobs, advantages, mask, low, high, clip_c, params):
    """Clip-Cov (arXiv 2505.22617): DAPO's clipped loss, with the gradient cut on a random
    clip_cov_ratio of the tokens whose covariance (A - mean A)(log pi - mean log pi) lies in
    (clip_cov_lb, clip_cov_ub) and that the clip left alone: the entropy-collapsing ones. The
    means and the draw are over this micro-batch's tokens (torch's global generator), as verl's."""
    adv = advantages.expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1.0 - low, 1.0 + high)
    by_clip = (clipped > unclipped) & mask
    cov = (adv - masked_mean(adv, mask)) * (logprobs - masked_mean(logprobs.detach(), mask))
    band = (cov < params.clip_cov_ub) & (cov > params.clip_cov_lb) & mask & ~by_clip
    count = max(int(params.clip_cov_ratio * int(mask.sum())), 1)
    picks = torch.nonzero(band)
    picks = picks[torch.randperm(len(picks))[:count]] if len(picks) else picks
    keep = torch.ones_like(log_ratio)
    keep[picks[:, 0], picks[:, 1]] = 0.0
    metrics = _zero_clips(ratio)
    metrics["pg_clipfrac"] = masked_mean((keep == 0).float(), mask)
    return torch.maximum(unclipped, clipped) * keep, metrics


def _kl_cov(log_ratio, logprobs, advantages, mask, low, high, clip_c, params):
    """KL-Cov (arXiv 2505.22617): -A r, plus ppo_kl_coef * |log r| on the kl_cov_ratio of this
    micro-batch's tokens with the largest covariance (A - mean A)(log pi - mean log pi)."""
    adv = advantages.expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    losses = -adv * ratio
    valid = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]
    if len(valid):
        a, lp = adv.detach().reshape(-1)[valid], logprobs.detach().reshape(-1)[valid]
        cov = (a - a.mean()) * (lp - lp.mean())
        top = valid[torch.topk(cov, max(1, int(len(cov) * params.kl_cov_ratio))).indices]
        penalty = torch.zeros(log_ratio.numel(), device=log_ratio.device, dtype=log_ratio.dtype)
        penalty[top] = params.ppo_kl_coef
        losses = losses + penalty.view_as(log_ratio) * log_ratio.abs()
    return losses, _zero_clips(ratio)


def _dro(log_ratio, logprobs, advantages, mask, low, high, clip_c, params):
    """DRO (verl docs/algo/dro.md): -(A log pi - beta / 2 (log pi - log pi_old)^2): a quadratic
    proximal penalty instead of a clip."""
    lp = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    return -(advantages * lp - 0.5 * params.dro_beta * log_ratio.square()), _zero_clips(log_ratio)


def _dppo(divergence: Callable):
    """DPPO (arXiv 2602.04879): a trust region on the divergence between the token's old and new
    probability instead of the ratio: -A * sg[min(r, C)] * log pi, kept only where the divergence
    stays within clip_ratio_high (A > 0) / clip_ratio_low (A <= 0); C is actor.clip_ratio_c
    (truncated importance sampling; 20 when the dual clip is off, as verl)."""
    def per_token(log_ratio, logprobs, advantages, mask, low, high, clip_c, params):
        ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
        cap = 20.0 if clip_c is None else clip_c
        prob, old_prob = torch.exp(logprobs), torch.exp(logprobs - log_ratio)
        valid = torch.where(advantages > 0, *divergence(prob, old_prob, logprobs, log_ratio, low, high)).detach()
        lp = torch.where(mask, logprobs, torch.zeros_like(logprobs))
        losses = -advantages * ratio.clamp(max=cap).detach() * lp * valid
        metrics = _zero_clips(ratio)
        metrics["pg_clipfrac"] = masked_mean(1.0 - valid.float(), mask)
        metrics["pg_clipfrac_lower"] = masked_mean((ratio > cap).float() * valid, mask)
        return losses, metrics
    return per_token


def _total_variation(prob, old_prob, logprobs, log_ratio, low, high):
    """(valid where A > 0, where A <= 0): the probability moved up at most `high`, down at most `low`."""
    return (prob - old_prob) <= high, (prob - old_prob) >= -low


def _binary_kl(prob, old_prob, logprobs, log_ratio, low, high):
    """The KL between the two Bernoullis (the token, the rest) old -> new, bounded in the direction
    the advantage pushes: `high` where the probability rose (A > 0), `low` where it fell."""
    kl = old_prob * log_ratio.neg() + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    return (kl <= high) | (prob <= old_prob), (kl <= low) | (prob >= old_prob)


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
    # (log_ratio, logprobs, advantages, mask, low, high, clip_c, params: LossParams) -> ([B, T] losses, metrics)
    per_token: Callable
    agg: Optional[str]  # the actor.loss_agg_mode the objective is defined with (None: any)
    # The rollout correction's rho is pi / pi_rollout with pi the policy being trained (detached),
    # not pi_old: a loss with no ratio of its own takes the importance weight there.
    weighs_current: bool = False
    # One loss per sequence: the correction's token weights enter as their geometric mean over the
    # sequence (GMPO), not token by token.
    sequence_weight: bool = False


# actor.policy_loss -> its row. The clip ratios are actor.clip_ratio_low / _high in every row
# (GSPO's paper uses ~3e-4 / 4e-4 on its sequence ratio); the dual clip (clip_ratio_c) is DAPO's.
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "dapo": PolicyLoss(_dapo, None),
    "gspo": PolicyLoss(_gspo, "seq-mean-token-mean"),
    "gspo_token": PolicyLoss(_gspo_token, None),
    "cispo": PolicyLoss(_cispo, None),
    "reinforce": PolicyLoss(_reinforce, None, weighs_current=True),
    # verl's other registered losses (verl/trainer/ppo/core_algos.py), its loss_mode names
    "sapo": PolicyLoss(_sapo, "seq-mean-token-mean"),
    "geo_mean": PolicyLoss(_geo_mean, "seq-mean-token-mean", sequence_weight=True),
    "clip_cov": PolicyLoss(_clip_cov, None),
    "kl_cov": PolicyLoss(_kl_cov, None),
    "gpg": PolicyLoss(_reinforce, None),  # -A log pi; its correction against pi_old
    "dro": PolicyLoss(_dro, None),
    "dppo_tv": PolicyLoss(_dppo(_total_variation), None),
    "dppo_kl": PolicyLoss(_dppo(_binary_kl), None),
}


def compute_policy_loss(old_logprobs: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor,
                        loss_mask: torch.Tensor, *, clip_ratio_low: float, clip_ratio_high: float,
                        clip_ratio_c: Optional[float] = None, loss_agg_mode: str = "token-mean",
                        policy_loss: str = "dapo", rollout_logprobs: Optional[torch.Tensor] = None,
                        correction: Optional[Correction] = None, params: LossParams = LossParams(),
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
                                       clip_ratio_c, params)
    if correction is not None and correction.active:
        anchor = logprobs.detach() if row.weighs_current else old_logprobs
        factor, extra = rollout_correction(anchor, rollout_logprobs, mask, correction)
        if row.sequence_weight:  # verl's geometric mean of the sequence's weights (1e-10: a rejected token)
            factor = torch.exp(_masked_row_mean(torch.log(factor + 1e-10), mask)).expand_as(factor)
        pg_losses = pg_losses * factor
        metrics.update(extra)
    loss = agg_loss(pg_losses, loss_mask, loss_agg_mode,
                    global_token_count=global_token_count, global_seq_count=global_seq_count)
    metrics["pg_loss"] = loss
    metrics["ppo_kl"] = masked_mean(-log_ratio, mask)
    return loss, {k: v.detach() for k, v in metrics.items()}
