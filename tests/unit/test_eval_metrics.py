"""pass@k and maj@k (reward/metrics.py) against brute force over every subset of k samples,
written independently: random correctness tables, k = n, all wrong and all right groups."""
import itertools
import random

import pytest

from dapo_megatron.reward import metrics as m


def brute_pass(correct, k):
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def brute_maj(answers, correct, k):
    wins = []
    for idx in itertools.combinations(range(len(answers)), k):
        first, counts = {}, {}
        for pos, i in enumerate(idx):
            if answers[i]:
                first.setdefault(answers[i], pos)
                counts[answers[i]] = counts.get(answers[i], 0) + 1
        if not counts:
            wins.append(False)
            continue
        winner = sorted(counts, key=lambda a: (-counts[a], first[a]))[0]
        wins.append(next(correct[i] for i in idx if answers[i] == winner))
    return sum(wins) / len(wins)


@pytest.mark.parametrize("seed", range(12))
def test_pass_and_maj_match_brute_force(seed):
    rng = random.Random(seed)
    n = rng.choice([1, 2, 3, 5, 8])
    answers = [rng.choice(["", "1", "2", "3"]) for _ in range(n)]
    correct = [a == "2" for a in answers]  # an answer's correctness is the answer's
    for k in m.ks_for(n):
        assert m.pass_at_k(n, sum(correct), k) == pytest.approx(brute_pass(correct, k))
        got, method = m.maj_at_k(answers, correct, k)
        assert method == "exact" and got == pytest.approx(brute_maj(answers, correct, k))


def test_edges():
    assert m.ks_for(8) == [1, 2, 4, 8] and m.ks_for(6) == [1, 2, 4, 6] and m.ks_for(1) == [1]
    wrong = m.group_metrics(["1"] * 4, [False] * 4)
    right = m.group_metrics(["2"] * 4, [True] * 4)
    assert all(v == 0 for v in wrong.values()) and all(v == 1 for v in right.values())
    # k = n: pass@n is "any correct", maj@n the one vote over all samples; a tie goes to the first seen
    g = m.group_metrics(["5", "7", "7", "5"], [False, True, True, False])
    assert g["pass@4"] == 1 and g["maj@4"] == 0 and g["avg@4"] == 0.5
    assert m.group_metrics(["\\frac{1}{2}", "\\dfrac{1}{2}", "3"], [True, True, False])["maj@3"] == 1  # normalized
    with pytest.raises(ValueError, match="k"):
        m.pass_at_k(4, 1, 5)


def test_many_samples_use_a_seeded_bootstrap():
    rng = random.Random(0)
    answers = [rng.choice("abc") for _ in range(32)]
    correct = [a == "a" for a in answers]
    first, method = m.maj_at_k(answers, correct, 16)
    assert method == "bootstrap" and m.maj_at_k(answers, correct, 16) == (first, method)
    assert m.maj_method(32) == "bootstrap" and m.maj_method(8) == "exact"
    # the bootstrap estimates the exact mean: on 12 samples (exact) vs a forced bootstrap
    exact, _ = m.maj_at_k(answers[:12], correct[:12], 6)
    saved = m.MAJ_EXACT_SUBSETS
    try:
        m.MAJ_EXACT_SUBSETS = 0
        boot, method = m.maj_at_k(answers[:12], correct[:12], 6)
    finally:
        m.MAJ_EXACT_SUBSETS = saved
    assert method == "bootstrap" and abs(boot - exact) < 0.05


def test_validation_metrics_names_ours_and_verls_with_values_from_first_principles():
    """At k = n the formulas reduce to what a reader checks by hand: mean@n the share correct,
    pass@n whether any sample is, maj@n whether the most frequent answer (ties: first seen) is."""
    from dapo_megatron.reward.metrics import validation_metrics
    prompts = [("math", ["1", "2", "2", "3"], [True, False, False, False]),  # majority "2": wrong
               ("math", ["5", "5", "4", "5"], [True, True, False, True]),
               ("geo", ["a", "b", "a", "b"], [False, True, False, True]),  # tie: "a" first, wrong
               ("geo", ["x", "x", "x", "x"], [False] * 4)]
    out = validation_metrics(prompts)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    correct = [c for _, _, c in prompts]
    assert out["val/acc/mean@4"] == pytest.approx(mean([mean(c) for c in correct]))
    assert out["val/pass@4"] == pytest.approx(mean([any(c) for c in correct])) == 0.75
    assert out["val/maj@4"] == pytest.approx(0.25)  # only the second prompt's majority is right
    assert out["val/pass@4/geo"] == 0.5 and out["val/maj@4/math"] == 0.5
    assert out["val-core/math/acc/mean@4"] == pytest.approx(0.5)
    assert out["val-core/math/acc/best@4/mean"] == 1.0 and out["val-core/geo/acc/maj@4/mean"] == 0.0
    assert "val-aux/geo/acc/best@2/mean" in out and "val-core/geo/acc/best@2/mean" not in out
    assert out["val/pass@1"] == pytest.approx(out["val/acc/mean@4"])  # pass@1 is the mean
