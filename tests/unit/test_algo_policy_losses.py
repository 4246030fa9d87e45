"""Policy losses (DAPO, GSPO, GSPO-token, CISPO, REINFORCE) and rollout correction against oracles.

The oracles below are written from the papers' formulas, one sequence and one token at a time,
and import nothing from dapo_megatron.algo. Ours runs as the trainer runs it: the mini-batch split
over 2 DP ranks and 2 micro-batches each, every micro-batch normalised by the mini-batch's global
counts, losses and gradients summed. Loss and gradient must agree to 1e-6.
"""
import math

import pytest
import torch

from dapo_megatron.algo import Correction, compute_policy_loss

LOW, HIGH, DUAL = 0.2, 0.28, 3.0
TOL = 1e-6


# ---- oracles --------------------------------------------------------------------------------
def _clip_obj(ratio, adv):
    """-min(r A, clip(r) A): the PPO / DAPO per-sample loss."""
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - LOW, 1 + HIGH))


def oracle_weights(old, rollout, mask, c: dict) -> torch.Tensor:
    """Rollout-correction factor per token: IS weight (truncated / banded), 0 if masked or rejected."""
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t]]
        lr = [float(old[i, t] - rollout[i, t]) for t in idx]
        w = {t: 1.0 for t in idx}
        masked = set()
        if c.get("is_level"):
            for k, t in enumerate(idx):
                raw = {"token": math.exp(lr[k]), "sequence": math.exp(sum(lr)),
                       "geometric": math.exp(sum(lr) / len(lr))}[c["is_level"]]
                if c.get("is_mode", "truncate") == "truncate":
                    w[t] = min(raw, c["is_threshold"])
                else:
                    lo = c.get("is_threshold_lower") or 1 / c["is_threshold"]
                    w[t] = raw
                    if not lo <= raw <= c["is_threshold"]:
                        masked.add(t)
        rejected = set()
        if c.get("rs"):
            agg, est = c["rs"].rsplit("_", 1)
            per = [{"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[est] for x in lr]
            for k, t in enumerate(idx):
                v = {"token": per[k], "seq_sum": sum(per), "seq_mean": sum(per) / len(per), "seq_max": max(per)}[agg]
                if est == "k1":
                    lo = c.get("rs_threshold_lower") or 1 / c["rs_threshold"]
                    bad = not lo <= math.exp(-v) <= c["rs_threshold"]
                else:
                    bad = v > c["rs_threshold"]
                if bad:
                    rejected.add(t)
        if c.get("veto_threshold") and idx and min(math.exp(x) for x in lr) < c["veto_threshold"]:
            rejected |= set(idx)
        for t in idx:
            out[i, t] = 0.0 if t in masked | rejected else w[t]
    return out


def oracle_loss(mode, old, lp, adv, mask, agg, weights=None):
    """The loss of `mode` from its paper's formula, sequence by sequence (lp: the leaf)."""
    B, T = mask.shape
    per_seq, tokens = [], 0
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t]]
        tokens += len(idx)
        if not idx:
            per_seq.append([])
            continue
        a = adv[i]
        if mode == "gspo":  # s_i = (prod_t pi / pi_old)^(1 / |y_i|), clipped per sequence
            s = torch.exp(sum(lp[i, t] - old[i, t] for t in idx) / len(idx))
            losses = [_clip_obj(s, a)] * len(idx)  # every token carries the sequence's loss
        elif mode == "gspo_token":  # s_i,t = sg[s_i] * pi_t / sg[pi_t]
            s = torch.exp(sum(lp[i, t] - old[i, t] for t in idx).detach() / len(idx))
            losses = [_clip_obj(s * torch.exp(lp[i, t] - lp[i, t].detach()), a) for t in idx]
        elif mode == "reinforce":  # -A log pi_t (verl's compute_policy_loss_reinforce, its weight w below)
            losses = [-a * lp[i, t] for t in idx]
        elif mode == "cispo":  # -sg[clip(r_t)] A log pi_t
            losses = [-torch.clamp(torch.exp(lp[i, t] - old[i, t]), 1 - LOW, 1 + HIGH).detach() * a * lp[i, t]
                      for t in idx]
        else:  # dapo: clip-higher, and for A < 0 the dual clip bound
            losses = []
            for t in idx:
                x = _clip_obj(torch.exp(lp[i, t] - old[i, t]), a)
                losses.append(torch.minimum(x, -a * DUAL) if a < 0 else x)
        if weights is not None:
            losses = [x * weights[i, t] for x, t in zip(losses, idx)]
        per_seq.append(losses)
    if agg == "token-mean":
        return sum(x for seq in per_seq for x in seq) / tokens
    return sum(sum(seq) / len(seq) for seq in per_seq if seq) / B  # seq-mean-token-mean


# ---- ours, as the trainer splits it ---------------------------------------------------------------
def ours(mode, old, lp, adv, mask, agg, rollout=None, correction=None):
    """Sum over 2 DP ranks x 2 micro-batches of each micro-batch's share (global counts)."""
    B = mask.shape[0]
    counts = dict(global_token_count=int(mask.sum()), global_seq_count=B)
    total, metrics = 0.0, []
    for rank in range(2):
        rows = list(range(rank, B, 2))  # a DP rank's rows
        for micro in (rows[: len(rows) // 2], rows[len(rows) // 2:]):
            loss, m = compute_policy_loss(
                old[micro], lp[micro], adv[micro], mask[micro], clip_ratio_low=LOW, clip_ratio_high=HIGH,
                clip_ratio_c=DUAL, loss_agg_mode=agg, policy_loss=mode,
                rollout_logprobs=None if rollout is None else rollout[micro], correction=correction, **counts)
            total = total + loss
            metrics.append(m)
    return total, metrics


def _case(seed=0, B=8, T=7, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[3] = 0  # an empty response (all of it masked)
    mask = torch.arange(T)[None] < lengths[:, None]
    base = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.1
    lp = (base + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    old = base.clone()
    rollout = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)  # one per response, as the trainer's
    garbage = torch.where(mask, lp.detach(), torch.full_like(lp.detach(), float("nan")))
    old = torch.where(mask, old, garbage)  # padding holds garbage that must not leak
    return old, lp, adv, mask, rollout


def _grad(loss, lp):
    (g,) = torch.autograd.grad(loss, lp, retain_graph=True)
    return torch.nan_to_num(g)


@pytest.mark.parametrize("mode,agg", [("dapo", "token-mean"), ("dapo", "seq-mean-token-mean"),
                                      ("gspo", "seq-mean-token-mean"), ("gspo_token", "token-mean"),
                                      ("gspo_token", "seq-mean-token-mean"), ("cispo", "token-mean")])
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_gradient_equal_the_oracle(mode, agg, seed):
    old, lp, adv, mask, _ = _case(seed)
    want = oracle_loss(mode, old, lp, adv, mask, agg)
    got, _ = ours(mode, old, lp, adv, mask, agg)
    assert abs(float(got.detach()) - float(want.detach())) <= TOL
    assert (_grad(got, lp) - _grad(want, lp)).abs().max() <= TOL
    assert _grad(got, lp).abs().max() > 0


def test_gspo_has_one_ratio_per_sequence():
    """A sequence whose tokens' log-ratios have opposite signs (+0.5, -0.5, +0.1: mean 0.033, inside the
    clip band although two tokens are outside it): one ratio, every token the same gradient, none clipped."""
    lp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    old = -torch.tensor([[0.5, -0.5, 0.1]], dtype=torch.float64)
    adv, mask = torch.ones(1, dtype=torch.float64), torch.ones(1, 3, dtype=torch.bool)
    loss, m = compute_policy_loss(old, lp, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                  loss_agg_mode="seq-mean-token-mean", policy_loss="gspo")
    g = _grad(loss, lp)[0]
    s = math.exp(0.1 / 3)
    assert float(loss.detach()) == pytest.approx(-s, abs=TOL)
    assert torch.allclose(g, torch.full_like(g, -s / 3), atol=TOL)  # d(-s)/d lp_t = -s / |y| for every t
    assert float(m["pg_clipfrac"]) == 0.0
    dapo, md = compute_policy_loss(old, lp, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                   loss_agg_mode="seq-mean-token-mean")
    assert float(md["pg_clipfrac"]) > 0  # token ratios: the +0.5 token is clipped


def test_gspo_token_equals_gspo_with_sequence_advantages():
    old, lp, adv, mask, _ = _case(3)
    per_token = adv[:, None].expand(mask.shape)  # every token carries its sequence's advantage
    a, _ = ours("gspo", old, lp, adv, mask, "seq-mean-token-mean")
    b, _ = ours("gspo_token", old, lp, per_token, mask, "seq-mean-token-mean")
    assert abs(float(a.detach()) - float(b.detach())) <= TOL and (_grad(a, lp) - _grad(b, lp)).abs().max() <= TOL


def test_cispo_gradient_reaches_clipped_tokens():
    old, lp, adv, mask, _ = _case(4, spread=1.0)
    ratio = torch.exp(lp.detach() - old)
    clipped = mask & ((ratio > 1 + HIGH) | (ratio < 1 - LOW))
    assert clipped.sum() >= 3
    g_cispo = _grad(ours("cispo", old, lp, adv, mask, "token-mean")[0], lp)
    g_dapo = _grad(ours("dapo", old, lp, adv, mask, "token-mean")[0], lp)
    assert (g_cispo[clipped] != 0).all()
    assert (g_dapo[clipped & (adv[:, None] > 0) & (ratio > 1 + HIGH)] == 0).all()  # PPO's clip stops them


CORRECTIONS = [
    dict(is_level="token", is_threshold=1.1),
    dict(is_level="sequence", is_threshold=1.3),
    dict(is_level="geometric", is_threshold=1.05),
    dict(is_level="token", is_mode="mask", is_threshold=1.15, is_threshold_lower=0.9),  # IcePop's band
    dict(is_level="sequence", is_mode="mask", is_threshold=1.5),
    dict(is_level="geometric", is_mode="mask", is_threshold=1.05, is_threshold_lower=0.97),
    dict(rs="token_k1", rs_threshold=1.2, rs_threshold_lower=0.85),
    dict(rs="seq_sum_k1", rs_threshold=1.3),
    dict(rs="seq_mean_k1", rs_threshold=1.05, rs_threshold_lower=0.97),
    dict(rs="token_k2", rs_threshold=0.01), dict(rs="seq_sum_k3", rs_threshold=0.05),
    dict(rs="seq_mean_k3", rs_threshold=0.01), dict(rs="seq_max_k2", rs_threshold=0.03),
    dict(rs="seq_max_k3", rs_threshold=0.03),
    dict(is_level="token", is_threshold=2.0, rs="seq_mean_k1", rs_threshold=1.05, veto_threshold=0.7),
]


@pytest.mark.parametrize("c", CORRECTIONS, ids=lambda c: "+".join(f"{k}={v}" for k, v in c.items()))
def test_rollout_correction_equals_the_oracle(c):
    """Weights, masks and rejections drop exactly the out-of-band tokens / sequences."""
    old, lp, adv, mask, rollout = _case(5)
    weights = oracle_weights(old, rollout, mask, c)
    want = oracle_loss("dapo", old, lp, adv, mask, "token-mean", weights)
    got, metrics = ours("dapo", old, lp, adv, mask, "token-mean", rollout, Correction(**c))
    assert abs(float(got.detach()) - float(want.detach())) <= TOL
    assert (_grad(got, lp) - _grad(want, lp)).abs().max() <= TOL
    dropped = int(((weights == 0) & mask).sum())
    assert 0 < dropped < int(mask.sum()) or not (c.get("rs") or c.get("is_mode") == "mask"), dropped
    key = "rejected_frac" if c.get("rs") else "is_masked_frac" if c.get("is_mode") == "mask" else "is_weight_mean"
    assert all(key in m for m in metrics)


# verl's bypass mode with loss_type=reinforce (core_algos.compute_policy_loss_bypass_mode): the IS
# weights come from compute_rollout_correction_and_rejection_mask(old_log_prob=log_prob, ...), i.e.
# the current policy against the rollout's, under no_grad; then L = agg(-A * log pi * w).
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("c", [None, dict(is_level="token", is_threshold=1.1), dict(is_level="sequence", is_threshold=1.3),
                               dict(is_level="token", is_threshold=2.0, rs="seq_mean_k1", rs_threshold=1.05)],
                         ids=lambda c: "plain" if c is None else "+".join(f"{k}={v}" for k, v in c.items()))
def test_reinforce_weighs_the_current_policy_against_the_rollouts(agg, c):
    old, lp, adv, mask, rollout = _case(6, spread=0.5)
    old = rollout  # bypass mode: pi_old is pi_rollout
    weights = None if c is None else oracle_weights(lp.detach(), rollout, mask, c)
    want = oracle_loss("reinforce", old, lp, adv, mask, agg, weights)
    got, metrics = ours("reinforce", old, lp, adv, mask, agg, rollout, None if c is None else Correction(**c))
    assert abs(float(got.detach()) - float(want.detach())) <= TOL
    assert (_grad(got, lp) - _grad(want, lp)).abs().max() <= TOL
    if c is not None:  # the weights bind: some truncated (or rejected), so not the plain loss's gradient
        plain, _ = ours("reinforce", old, lp, adv, mask, agg)
        assert (_grad(got, lp) - _grad(plain, lp)).abs().max() > 1e-3
        assert all(float(m["pg_clipfrac"]) == 0.0 for m in metrics)  # no clip of its own
