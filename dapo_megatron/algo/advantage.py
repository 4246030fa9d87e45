"""GRPO outcome advantages: each response's score relative to its group (the n responses of a prompt)."""
from __future__ import annotations

import torch


def compute_grpo_advantages(scores: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6,
                            norm_by_std: bool = True) -> torch.Tensor:
    """(score - group mean) / (group std + eps), std unbiased. [B] scores, [B] int group ids -> [B].

    Samples may come in any order. A single-member group has no std: like verl it uses mean 0 and
    std 1, so its advantage is score / (1 + eps) (score without norm_by_std). A group whose scores
    are all equal gets 0. Float32 result unless scores are float64.
    """
    out_dtype = scores.dtype if scores.dtype == torch.float64 else torch.float32
    x = scores.to(torch.float64)  # [B]; float64 so group sums of thousands of scores stay exact
    _, inverse, counts = torch.unique(torch.as_tensor(group_index), return_inverse=True, return_counts=True)
    inverse = inverse.to(x.device)
    counts = counts.to(x)  # [G]
    mean = torch.zeros_like(counts).index_add_(0, inverse, x) / counts  # [G]
    sq_dev = torch.zeros_like(counts).index_add_(0, inverse, (x - mean[inverse]).square())  # [G]
    std = (sq_dev / (counts - 1).clamp(min=1)).sqrt()  # [G], unbiased
    singleton = counts == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    adv = x - mean[inverse]  # [B]
    if norm_by_std:
        adv = adv / (std[inverse] + eps)
    return adv.to(out_dtype)
