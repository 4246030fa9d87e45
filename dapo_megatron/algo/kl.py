"""KL estimators, token entropy, and the rollout-vs-trainer log-prob check."""
from __future__ import annotations

import torch

from dapo_megatron.algo.loss import masked_mean

# Config spelling -> estimator (Schulman's k1/k2/k3); verl's names and the short ones both work.
KL_KINDS = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from tokens sampled by the policy. [B, T] -> [B, T].

    k1: logp - ref;  k2: 0.5 * (logp - ref)^2;  k3: exp(ref - logp) - (ref - logp) - 1, clamped to
    [-10, 10] like verl (k3 is unbiased and >= 0 but explodes when ref >> logp).
    """
    estimator = KL_KINDS.get(kind)
    if estimator is None:
        raise ValueError(f"unknown KL kind {kind!r}; set actor.kl_loss_type to one of {', '.join(KL_KINDS)}")
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs).square()
    log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)  # keeps exp() finite
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(l) - sum(softmax(l) * l). [..., V] -> [...].

    Needs the full vocabulary (gather vocab-parallel logits first) and finite logits.
    """
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def rollout_logprob_metrics(rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                            loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the rollout engine's log-probs are from the trainer's, over unmasked tokens [B, T].

    A growing gap means a broken weight sync or numerics drift (MoE routing, kernels). `rollout/kl`
    is k3 estimating KL(rollout || trainer), tokens being sampled by the rollout engine. Detached
    0-d tensors; all 0 for an empty mask.
    """
    with torch.no_grad():
        mask = loss_mask.bool()
        diff = torch.where(mask, (rollout_logprobs - old_logprobs).abs(), torch.zeros_like(old_logprobs))
        k3 = kl_penalty(rollout_logprobs, old_logprobs, "k3")
        return {
            "rollout/logprob_diff_max": diff.max() if diff.numel() else diff.new_zeros(()),
            "rollout/logprob_diff_mean": masked_mean(diff, mask),
            "rollout/kl": masked_mean(k3, mask),
        }
