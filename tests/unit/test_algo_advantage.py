"""GRPO advantages: hand values, unbiased std, singleton groups, order independence."""
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_megatron.algo import compute_grpo_advantages

# Group 0: [1, 0, 0] (mean 1/3, unbiased std 1/sqrt(3)); group 1: [1, 1] (std 0); group 2: singleton [5].
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 5.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 2])


def test_grpo_advantages_by_hand():
    adv = compute_grpo_advantages(SCORES, GROUPS)
    s3 = math.sqrt(3.0)  # biased std would give sqrt(2)/3 and 1.414 for the first member
    expected = [(2 / 3) * s3, -(1 / 3) * s3, -(1 / 3) * s3, 0.0, 0.0, 5.0 / (1 + 1e-6)]
    torch.testing.assert_close(adv, torch.tensor(expected))
    assert adv.dtype == torch.float32


def test_grpo_advantages_without_std():
    adv = compute_grpo_advantages(SCORES, GROUPS, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 5.0]))


def test_grpo_advantages_any_order_and_ids():
    perm = torch.tensor([5, 3, 0, 4, 2, 1])
    adv = compute_grpo_advantages(SCORES[perm], GROUPS[perm] * 7 + 100)
    torch.testing.assert_close(adv, compute_grpo_advantages(SCORES, GROUPS)[perm])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(-3, 3)), min_size=1, max_size=24), st.randoms())
def test_grpo_groups_sum_to_zero_and_permute(samples, rnd):
    groups = torch.tensor([g for g, _ in samples])
    scores = torch.tensor([float(s) for _, s in samples])
    adv = compute_grpo_advantages(scores, groups)
    for g in groups.unique():
        members = groups == g
        if members.sum() > 1:
            assert abs(adv[members].sum().item()) < 1e-4
    perm = list(range(len(samples)))
    rnd.shuffle(perm)
    torch.testing.assert_close(compute_grpo_advantages(scores[perm], groups[perm]), adv[perm])
