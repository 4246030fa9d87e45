"""The DAPO algorithm in pure torch: policy loss, advantages, KL, dynamic sampling, overlong shaping.

Imports torch and the standard library only, so it is testable without Megatron, vLLM or Ray.
"""
from dapo_megatron.algo.advantage import compute_grpo_advantages
from dapo_megatron.algo.kl import KL_KINDS, entropy_from_logits, kl_penalty, rollout_logprob_metrics
from dapo_megatron.algo.correction import IS_LEVELS, IS_MODES, RS_CRITERIA, Correction
from dapo_megatron.algo.loss import (LOSS_AGG_MODES, POLICY_LOSSES, LossParams, agg_loss, compute_policy_loss,
                                     loss_normalizer_counts, masked_mean)
from dapo_megatron.algo.sampling import ON_EXHAUSTED, DynamicSampler, Group, filter_groups
from dapo_megatron.algo.shaping import overlong_penalty

__all__ = [
    "IS_LEVELS", "IS_MODES", "KL_KINDS", "LOSS_AGG_MODES", "ON_EXHAUSTED", "POLICY_LOSSES", "RS_CRITERIA",
    "Correction", "DynamicSampler", "Group", "LossParams",
    "agg_loss", "compute_grpo_advantages", "compute_policy_loss",
    "entropy_from_logits", "filter_groups", "kl_penalty", "loss_normalizer_counts", "masked_mean",
    "overlong_penalty", "rollout_logprob_metrics",
]
