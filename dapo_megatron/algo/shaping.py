"""Overlong reward shaping (DAPO, "soft overlong punishment")."""
from __future__ import annotations

import torch


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """Penalty added to the reward of responses that run into the last `buffer_len` tokens.

    expected = max_response_length - buffer_len; exceed = len - expected;
    penalty = min(-exceed / buffer_len * penalty_factor, 0). Shape: [B] -> [B] (float).
    """
    if buffer_len <= 0:
        raise ValueError(f"overlong buffer_len must be > 0, got {buffer_len}; set reward.overlong_buffer.len")
    expected = max_response_length - buffer_len
    exceed = response_lengths.to(torch.float64) - expected
    penalty = torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
    return penalty.to(torch.float32)
