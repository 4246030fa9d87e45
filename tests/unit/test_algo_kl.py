"""KL estimators, token entropy, rollout-vs-trainer log-prob metrics."""
import math

import pytest
import torch

from dapo_megatron.algo import entropy_from_logits, kl_penalty, rollout_logprob_metrics


@pytest.mark.parametrize("kind,expected", [
    ("kl", [0.0, math.log(2)]), ("k1", [0.0, math.log(2)]),
    ("mse", [0.0, 0.5 * math.log(2) ** 2]), ("k2", [0.0, 0.5 * math.log(2) ** 2]),
    # ref - logp = -ln 2: exp(-ln 2) + ln 2 - 1
    ("low_var_kl", [0.0, 0.5 + math.log(2) - 1]), ("k3", [0.0, 0.5 + math.log(2) - 1]),
])
def test_kl_penalty_by_hand(kind, expected):
    out = kl_penalty(torch.tensor([0.0, math.log(2)]), torch.zeros(2), kind)
    torch.testing.assert_close(out, torch.tensor(expected))


def test_k3_is_clamped_and_unknown_kind_names_key():
    assert kl_penalty(torch.zeros(1), torch.full((1,), 30.0), "k3").item() == 10.0
    with pytest.raises(ValueError, match=r"actor\.kl_loss_type"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_entropy_from_logits():
    p = 1 / (1 + math.e)  # softmax([1, 2])[0]
    expected = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    out = entropy_from_logits(torch.tensor([[1.0, 2.0], [0.0, 0.0]]))
    torch.testing.assert_close(out, torch.tensor([expected, math.log(2)]))


def test_rollout_logprob_metrics():
    rollout = torch.tensor([[0.0, -1.0, 5.0]])
    old = torch.tensor([[0.0, -0.5, 0.0]])
    m = rollout_logprob_metrics(rollout, old, torch.tensor([[1, 1, 0]]))
    assert m["rollout/logprob_diff_max"].item() == pytest.approx(0.5)
    assert m["rollout/logprob_diff_mean"].item() == pytest.approx(0.25)
    assert m["rollout/kl"].item() == pytest.approx((math.exp(0.5) - 0.5 - 1) / 2)
    empty = rollout_logprob_metrics(rollout, old, torch.zeros(1, 3))
    assert all(v.item() == 0.0 for v in empty.values())
