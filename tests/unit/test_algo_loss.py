"""Policy loss and loss aggregation: hand-computed values, clip branches, micro-batch equivalence."""
import math

import pytest
import torch

from dapo_megatron.algo import (LOSS_AGG_MODES, Correction, agg_loss, compute_policy_loss, loss_normalizer_counts,
                                masked_mean)
from dapo_megatron.algo.correction import rollout_correction

NAN = float("nan")
# Row 0 full, row 1 one token, row 2 empty; garbage (NaN) in a masked slot must not leak.
LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [NAN, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", (6 + 4) / 4),
    ("seq-mean-token-sum", (6 + 4 + 0) / 3),
    ("seq-mean-token-mean", (2 + 4 + 0) / 3),
    ("seq-mean-token-sum-norm", (6 + 4) / (3 * 3)),
])
def test_agg_loss_modes_by_hand(mode, expected):
    assert agg_loss(LOSS_MAT, MASK, mode).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", 10 / 8), ("seq-mean-token-sum", 10 / 6), ("seq-mean-token-mean", 6 / 6),
    ("seq-mean-token-sum-norm", 10 / (6 * 3)),
])
def test_agg_loss_global_counts(mode, expected):
    out = agg_loss(LOSS_MAT, MASK, mode, global_token_count=8, global_seq_count=6)
    assert out.item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_empty_mask_is_zero(mode):
    assert agg_loss(LOSS_MAT, torch.zeros(3, 3), mode).item() == 0.0


def test_agg_loss_unknown_mode_names_key_and_choices():
    with pytest.raises(ValueError, match=r"actor\.loss_agg_mode.*seq-mean-token-sum-norm"):
        agg_loss(LOSS_MAT, MASK, "sum")


def test_masked_mean_and_counts():
    assert masked_mean(LOSS_MAT, MASK).item() == pytest.approx(2.5)
    assert masked_mean(LOSS_MAT, torch.zeros(3, 3)).item() == 0.0
    assert loss_normalizer_counts(MASK) == (4, 3)


def _branch_case():
    """Tokens a..e hit: upper clip, lower clip, dual clip, nothing, nothing; f is masked."""
    ratios = torch.tensor([[1.5, 0.5, 4.0], [1.0, 1.1, 1e6]])
    adv = torch.tensor([[1.0, -1.0, -1.0], [1.0, -2.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    logprobs = ratios.log().requires_grad_()
    return torch.zeros(2, 3), logprobs, adv, mask


def test_policy_loss_each_clip_branch_by_hand():
    old, logprobs, adv, mask = _branch_case()
    loss, m = compute_policy_loss(old, logprobs, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                  clip_ratio_c=3.0)
    # a: max(-1.5, -1.28) = -1.28; b: max(0.5, 0.8) = 0.8; c: min(max(4, 1.28), 3) = 3; d: -1; e: 2.2
    assert loss.item() == pytest.approx((-1.28 + 0.8 + 3.0 - 1.0 + 2.2) / 5)
    assert m["pg_loss"].item() == pytest.approx(loss.item())
    assert (m["pg_clipfrac"].item(), m["pg_clipfrac_lower"].item(), m["pg_clipfrac_dual"].item()) == \
        pytest.approx((0.2, 0.2, 0.2))
    assert m["ppo_kl"].item() == pytest.approx(-math.log(1.5 * 0.5 * 4.0 * 1.0 * 1.1) / 5)
    loss.backward()
    # Clipped tokens get no gradient; unclipped: d(-A*r)/dlogp = -A*r, over 5 tokens.
    expected = torch.tensor([[0.0, 0.0, 0.0], [-1.0 / 5, 2.0 * 1.1 / 5, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)


def test_policy_loss_without_dual_clip_and_with_row_advantages():
    old, logprobs, _, mask = _branch_case()
    loss, m = compute_policy_loss(old, logprobs, torch.tensor([-1.0, 1.0]), mask,
                                  clip_ratio_low=0.2, clip_ratio_high=0.28)
    # row 0, A=-1: max(1.5, 1.28) + max(0.5, 0.8) + max(4, 1.28); row 1, A=+1: max(-1, -1) + max(-1.1, -1.1)
    assert loss.item() == pytest.approx((1.5 + 0.8 + 4.0 - 1.0 - 1.1) / 5)
    assert (m["pg_clipfrac"].item(), m["pg_clipfrac_lower"].item(), m["pg_clipfrac_dual"].item()) == \
        pytest.approx((0.0, 0.2, 0.0))


def test_dual_clip_must_exceed_one():
    old, logprobs, adv, mask = _branch_case()
    with pytest.raises(ValueError, match=r"actor\.clip_ratio_c"):
        compute_policy_loss(old, logprobs, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1.0)


def test_is_clipfrac_counts_the_unmasked_weights_truncated():
    """actor/is_clipfrac: the share of the batch's tokens whose weight the cap lowered; a padded
    token (weight 8 here) is not one of them, and a mask band truncates nothing."""
    old = torch.zeros(2, 3)
    rollout = torch.log(torch.tensor([[0.25, 2.0, 0.125], [1.0, 0.4, 1.0]]))  # weights 4, 0.5, 8 | 1, 2.5, 1
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    _, m = rollout_correction(old, rollout, mask, Correction(is_level="token", is_threshold=2.0))
    assert m["is_clipfrac"].item() == pytest.approx(2 / 5)  # 4 and 2.5 of the five unmasked
    _, m = rollout_correction(old, rollout, mask, Correction(is_level="token", is_mode="mask", is_threshold=2.0))
    assert m["is_clipfrac"].item() == 0 and m["is_masked_frac"].item() == pytest.approx(2 / 5)


def test_truncated_importance_sampling():
    zeros = torch.zeros(1, 2)
    rollout = torch.tensor([[-math.log(2.0), math.log(2.0)]])  # weights exp(0 - rollout) = 2 -> cap 1.5, 0.5
    kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
    tis = Correction(is_level="token", is_threshold=1.5)
    loss, m = compute_policy_loss(zeros, zeros, torch.ones(1), torch.ones(1, 2), rollout_logprobs=rollout,
                                  correction=tis, **kwargs)
    assert loss.item() == pytest.approx((-1.5 - 0.5) / 2)
    assert m["is_weight_mean"].item() == pytest.approx(1.0) and m["is_masked_frac"].item() == 0
    assert m["is_clipfrac"].item() == 0.5  # the 2 the cap lowered, of two tokens
    plain, m = compute_policy_loss(zeros, zeros, torch.ones(1), torch.ones(1, 2), rollout_logprobs=rollout, **kwargs)
    assert plain.item() == pytest.approx(-1.0) and "is_weight_mean" not in m
    with pytest.raises(ValueError, match="rollout_logprobs"):
        compute_policy_loss(zeros, zeros, torch.ones(1), torch.ones(1, 2), correction=tis, **kwargs)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_four_micro_batches_match_one(mode):
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(8, 5, generator=gen, requires_grad=True)
    old = torch.nn.functional.logsigmoid(theta.detach() + 0.3 * torch.randn(8, 5, generator=gen))
    adv = torch.randn(8, generator=gen)
    lengths = torch.tensor([5, 3, 0, 1, 4, 2, 0, 5])  # ragged, with empty rows
    mask = torch.arange(5) < lengths.unsqueeze(-1)
    kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode)

    full, _ = compute_policy_loss(old, torch.nn.functional.logsigmoid(theta), adv, mask, **kwargs)
    (full_grad,) = torch.autograd.grad(full, theta)

    tokens, seqs = loss_normalizer_counts(mask)
    logprobs = torch.nn.functional.logsigmoid(theta)
    parts = [compute_policy_loss(old[i:i + 2], logprobs[i:i + 2], adv[i:i + 2], mask[i:i + 2],
                                 global_token_count=tokens, global_seq_count=seqs, **kwargs)[0]
             for i in range(0, 8, 2)]
    (micro_grad,) = torch.autograd.grad(sum(parts), theta)
    assert full_grad.abs().sum() > 0
    torch.testing.assert_close(sum(parts), full)
    torch.testing.assert_close(micro_grad, full_grad)
