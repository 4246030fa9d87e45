"""Overlong reward shaping."""
import pytest
import torch

from dapo_megatron.algo import overlong_penalty


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 16, 18, 20])  # expected = 20 - 4 = 16
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4, 1.0), torch.tensor([0.0, 0.0, -0.5, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4, 2.0), torch.tensor([0.0, 0.0, -1.0, -2.0]))
    with pytest.raises(ValueError, match=r"reward\.overlong_buffer\.len"):
        overlong_penalty(lengths, 20, 0, 1.0)
