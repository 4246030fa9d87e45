"""verl's other registered policy losses as rows of algo/loss.POLICY_LOSSES: SAPO, GMPO (geo_mean),
Clip-Cov, KL-Cov, GPG, DRO, DPPO-TV and DPPO-KL.

Each is checked on hand-computed cases, then against a reference written in this file from verl's
functions (verl/trainer/ppo/core_algos.py, verl-project/verl @ 1dda039, read with `fetch`), token
by token, importing nothing from dapo_megatron.algo: value and gradient in float64, every
aggregation the row allows, masked tokens holding NaN, the dual-clip bound where a loss reads it
(DPPO's truncation) and a correction weight. Ours runs as the trainer runs it: 2 DP ranks x 2
micro-batches, each normalised by the mini-batch's global counts. Clip-Cov and KL-Cov take their
statistics over one micro-batch (as verl's): their references run per micro-batch too.
"""
import math

import pytest
import torch

from dapo_megatron.algo import Correction, LossParams, compute_policy_loss

LOW, HIGH, CAP = 0.2, 0.28, 3.0
TOL = 1e-7
PARAMS = LossParams(tau_pos=1.0, tau_neg=1.05, clip_cov_ratio=0.2, clip_cov_lb=-0.5, clip_cov_ub=5.0,
                    kl_cov_ratio=0.1, ppo_kl_coef=0.3, dro_beta=0.7)


def _one(mode, lp, old, adv, params=PARAMS, clip_c=CAP, agg="token-mean"):
    """Our loss of a single token (or row), and its gradient by lp."""
    lp = torch.tensor([[lp]], dtype=torch.float64, requires_grad=True)
    loss, m = compute_policy_loss(torch.tensor([[old]], dtype=torch.float64), lp, torch.tensor([adv], dtype=torch.float64),
                                  torch.ones(1, 1, dtype=torch.bool), clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                  clip_ratio_c=clip_c, loss_agg_mode=agg, policy_loss=mode, params=params)
    loss.backward()
    return float(loss.detach()), float(lp.grad), m


# ---- hand-computed ---------------------------------------------------------------------------
def test_sapo_is_the_policy_gradient_on_policy_and_fades_off_it():
    """f(r) = sigmoid(tau (r - 1)) 4 / tau: f(1) = 2 / tau and d f / d log pi = r f'(r) = 1 at r = 1."""
    loss, grad, m = _one("sapo", -1.0, -1.0, 1.0, agg="seq-mean-token-mean")
    assert loss == pytest.approx(-2.0) and grad == pytest.approx(-1.0)
    loss, grad, _ = _one("sapo", -1.0, -1.0, -1.0, agg="seq-mean-token-mean")  # tau_neg 1.05
    assert loss == pytest.approx(2.0 / 1.05) and grad == pytest.approx(1.0)
    r = math.exp(1.0)  # off policy (r = e): the gradient is r f'(r) = 4 r sig (1 - sig)
    sig = 1 / (1 + math.exp(-(r - 1)))
    _, grad, m = _one("sapo", 0.0, -1.0, 1.0, agg="seq-mean-token-mean")
    assert grad == pytest.approx(-r * 4 * sig * (1 - sig)) and float(m["pg_clipfrac"]) == 0
    _, grad, _ = _one("sapo", 2.0, -1.0, 1.0, agg="seq-mean-token-mean")  # r = e^3: faded, not cut (no hard clip)
    assert 0 < -grad < 1e-5


def test_dro_is_the_policy_gradient_minus_a_quadratic_pull():
    loss, grad, _ = _one("dro", -1.0, -1.5, 2.0)
    assert loss == pytest.approx(-(2.0 * -1.0 - 0.5 * 0.7 * 0.25)) and grad == pytest.approx(-(2.0 - 0.7 * 0.5))


def test_gpg_is_minus_a_log_pi():
    loss, grad, _ = _one("gpg", -1.2, -0.3, 0.5)
    assert loss == pytest.approx(0.6) and grad == pytest.approx(-0.5)


def test_gmpo_takes_the_geometric_mean_of_pessimistically_clipped_ratios():
    """Two tokens, A = 1: log-ratios 0.5 (past high: 0.28 counts) and -0.1 -> exp((0.28 - 0.1) / 2)."""
    lp = torch.tensor([[0.5, -0.1]], dtype=torch.float64, requires_grad=True)
    loss, m = compute_policy_loss(torch.zeros(1, 2, dtype=torch.float64), lp, torch.tensor([1.0], dtype=torch.float64),
                                  torch.ones(1, 2, dtype=torch.bool), clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                  loss_agg_mode="seq-mean-token-mean", policy_loss="geo_mean", params=PARAMS)
    loss.backward()
    assert float(loss) == pytest.approx(-math.exp(0.09), rel=1e-7)
    # the clipped token gets no gradient; the other d/dlp of -exp(mean) = -exp(0.09) / 2
    assert lp.grad.tolist()[0] == pytest.approx([0.0, -math.exp(0.09) / 2], rel=1e-7)
    assert float(m["pg_clipfrac"]) == 0.5 and float(m["pg_clipfrac_lower"]) == 0.0


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
def test_dppo_drops_tokens_whose_probability_moved_too_far_the_advantages_way(mode):
    """p_old = 0.5: up to 0.9 with A > 0 is outside both regions (TV 0.4 > 0.28; binary KL 0.37 > 0.28):
    no gradient; down to 0.45 with A > 0 is inside (it moved against A); the kept token's loss is
    -A sg[min(r, C)] log pi."""
    old = math.log(0.5)
    loss, grad, m = _one(mode, math.log(0.9), old, 1.0)
    assert loss == 0.0 and grad == 0.0 and float(m["pg_clipfrac"]) == 1.0
    loss, grad, m = _one(mode, math.log(0.45), old, 1.0)
    assert loss == pytest.approx(-0.9 * math.log(0.45)) and grad == pytest.approx(-0.9) and float(m["pg_clipfrac"]) == 0
    # within the region, the truncation: r = 1.9 / 0.5 capped at C = 1.5 (a TV of 0.05 and a binary KL of 0.0004)
    loss, _, m = _one(mode, math.log(0.05), math.log(0.02), 1.0, clip_c=1.5)
    assert loss == pytest.approx(-1.5 * math.log(0.05)) and float(m["pg_clipfrac_lower"]) == 1.0


# ---- references from verl's functions --------------------------------------------------------
def _sig(x):
    return 1 / (1 + torch.exp(-x))


def reference_token_losses(mode, old, lp, adv, mask, weights=None):
    """[B][t] losses of `mode`, token by token, as verl's compute_policy_loss_<mode> (before its
    aggregation), with the rollout-correction weight multiplied in; lp: the leaf."""
    out = []
    for i in range(mask.shape[0]):
        idx = [t for t in range(mask.shape[1]) if mask[i, t]]
        a = adv[i]
        row = []
        if mode == "geo_mean" and idx:  # one loss per sequence on each token
            terms = []
            for t in idx:
                x = lp[i, t] - old[i, t]
                xc = torch.clamp(x, -LOW, HIGH)
                sgn = torch.sign(a)
                terms.append(sgn * torch.minimum(sgn * x, sgn * xc))
            n = len(idx)
            seq = -(a * n / (n + 1e-8)) * torch.exp(sum(terms) / (n + 1e-8))
            if weights is not None:  # verl: the geometric mean of the sequence's weights
                seq = seq * math.exp(sum(math.log(float(weights[i, t]) + 1e-10) for t in idx) / (n + 1e-8))
            out.append([seq] * n)
            continue
        for t in idx:
            x = lp[i, t] - old[i, t]
            r = torch.exp(x)
            if mode == "sapo":
                tau = PARAMS.tau_pos if a > 0 else PARAMS.tau_neg
                loss = -_sig(tau * (r - 1)) * (4.0 / tau) * a
            elif mode == "gpg":
                loss = -lp[i, t] * a
            elif mode == "dro":
                loss = -(lp[i, t] * a - 0.5 * PARAMS.dro_beta * x ** 2)
            else:  # dppo_tv / dppo_kl
                p, q = torch.exp(lp[i, t]).detach(), math.exp(float(old[i, t]))
                if mode == "dppo_tv":
                    ok = (p - q <= HIGH) if a > 0 else (p - q >= -LOW)
                else:
                    kl = q * (float(old[i, t]) - torch.log(p)) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
                    ok = (kl <= HIGH or p <= q) if a > 0 else (kl <= LOW or p >= q)
                loss = -a * torch.clamp(r, max=CAP).detach() * lp[i, t] * float(bool(ok))
            row.append(loss * (1.0 if weights is None else float(weights[i, t])))
        out.append(row)
    return out


def _aggregate(per_seq, agg, tokens, rows):
    if agg == "token-mean":
        return sum(x for seq in per_seq for x in seq) / tokens
    return sum(sum(seq) / len(seq) for seq in per_seq if seq) / rows  # seq-mean-token-mean


def _case(seed=0, B=8, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[3] = 0  # an empty response
    mask = torch.arange(T)[None] < lengths[:, None]
    base = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.05
    lp = (base + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    old = torch.where(mask, base, torch.full_like(base, float("nan")))  # padding holds garbage
    rollout = base + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[5] = 0.0  # A = 0 takes the A <= 0 branch
    return old, lp, adv, mask, rollout


def _weights(old, rollout, mask):
    """Token-level truncated IS weights, min(exp(old - rollout), 2): our default correction."""
    return torch.where(mask, torch.exp(torch.nan_to_num(old) - rollout).clamp(max=2.0), torch.zeros_like(rollout))


def ours(mode, old, lp, adv, mask, agg, rollout=None):
    """2 DP ranks x 2 micro-batches, each the mini-batch's share (global counts)."""
    counts = dict(global_token_count=int(mask.sum()), global_seq_count=mask.shape[0])
    correction = Correction(is_level="token", is_threshold=2.0) if rollout is not None else None
    total, metrics = 0.0, []
    for rank in range(2):
        rows = list(range(rank, mask.shape[0], 2))
        for micro in (rows[: len(rows) // 2], rows[len(rows) // 2:]):
            loss, m = compute_policy_loss(old[micro], lp[micro], adv[micro], mask[micro], clip_ratio_low=LOW,
                                          clip_ratio_high=HIGH, clip_ratio_c=CAP, loss_agg_mode=agg, policy_loss=mode,
                                          rollout_logprobs=None if rollout is None else rollout[micro],
                                          correction=correction, params=PARAMS, **counts)
            total = total + loss
            metrics.append(m)
    return total, metrics


def _grad(loss, lp):
    (g,) = torch.autograd.grad(loss, lp, retain_graph=True)
    return torch.nan_to_num(g)


CASES = [(mode, agg) for mode in ("gpg", "dro", "dppo_tv", "dppo_kl")
         for agg in ("token-mean", "seq-mean-token-mean")] + [("sapo", "seq-mean-token-mean"),
                                                              ("geo_mean", "seq-mean-token-mean")]


@pytest.mark.parametrize("mode,agg", CASES)
@pytest.mark.parametrize("corrected", [False, True], ids=["plain", "corrected"])
def test_loss_and_gradient_equal_verls(mode, agg, corrected):
    old, lp, adv, mask, rollout = _case(seed=1 if corrected else 0)
    weights = _weights(old, rollout, mask) if corrected else None
    want = _aggregate(reference_token_losses(mode, old, lp, adv, mask, weights), agg, int(mask.sum()), mask.shape[0])
    got, _ = ours(mode, old, lp, adv, mask, agg, rollout if corrected else None)
    assert abs(float(got.detach()) - float(want.detach())) <= TOL, (float(got), float(want))
    assert (_grad(got, lp) - _grad(want, lp)).abs().max() <= TOL
    assert _grad(got, lp).abs().max() > 0


def _cov_reference(mode, old, lp, adv, mask, seed):
    """verl's Clip-Cov / KL-Cov over one micro-batch (its means, its draw, its top-k), token losses
    in the order torch.nonzero visits them."""
    valid = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    a_mean = sum(float(adv[i]) for i, _ in valid) / len(valid)
    lp_mean = sum(float(lp[i, t]) for i, t in valid) / len(valid)
    cov = {(i, t): (float(adv[i]) - a_mean) * (float(lp[i, t]) - lp_mean) for i, t in valid}
    losses = {}
    for i, t in valid:
        r = torch.exp(lp[i, t] - old[i, t])
        if mode == "clip_cov":
            losses[i, t] = torch.maximum(-adv[i] * r, -adv[i] * torch.clamp(r, 1 - LOW, 1 + HIGH))
        else:
            losses[i, t] = -adv[i] * r
    if mode == "clip_cov":
        by_clip = {k for k in valid if float(-adv[k[0]] * torch.clamp(torch.exp(lp[k] - old[k]), 1 - LOW, 1 + HIGH))
                   > float(-adv[k[0]] * torch.exp(lp[k] - old[k]))}
        band = [k for k in valid if PARAMS.clip_cov_lb < cov[k] < PARAMS.clip_cov_ub and k not in by_clip]
        torch.manual_seed(seed)
        count = max(int(PARAMS.clip_cov_ratio * len(valid)), 1)
        cut = [band[j] for j in torch.randperm(len(band))[:count].tolist()] if band else []
        for k in cut:
            losses[k] = losses[k] * 0.0
        return losses, len(cut) / len(valid)
    ranked = sorted(valid, key=lambda k: -cov[k])[:max(1, int(len(valid) * PARAMS.kl_cov_ratio))]
    for k in ranked:
        losses[k] = losses[k] + PARAMS.ppo_kl_coef * torch.abs(lp[k] - old[k])
    return losses, 0.0


@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_covariance_losses_equal_verls_on_one_micro_batch(mode, agg):
    old, lp, adv, mask, _ = _case(seed=2, B=6, T=9)
    want_tokens, cut = _cov_reference(mode, old, lp, adv, mask, seed=5)
    per_seq = [[want_tokens[i, t] for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]
    want = _aggregate(per_seq, agg, int(mask.sum()), mask.shape[0])
    torch.manual_seed(5)  # the draw among the band's tokens: verl's randperm on torch's global generator
    got, m = compute_policy_loss(old, lp, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH, clip_ratio_c=CAP,
                                 loss_agg_mode=agg, policy_loss=mode, params=PARAMS)
    assert abs(float(got.detach()) - float(want.detach())) <= TOL
    assert (_grad(got, lp) - _grad(want, lp)).abs().max() <= TOL
    assert float(m["pg_clipfrac"]) == pytest.approx(cut)
    if mode == "clip_cov":
        assert cut > 0  # some gradient was cut: the band and the ratio reach tokens here
    else:  # the KL term changed the loss: 4 of the 36 tokens carry it
        plain, _ = compute_policy_loss(old, lp, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                       loss_agg_mode=agg, policy_loss="kl_cov", params=LossParams(kl_cov_ratio=1e-9,
                                                                                                ppo_kl_coef=0.0))
        assert float(got) > float(plain)
