"""Evaluation metrics over n scored samples per prompt: avg@n, pass@k, maj@k.

pass@k is the unbiased estimator of Chen et al. (2021): the chance that at least one of k
samples drawn without replacement from the n is correct, 1 - C(n - c, k) / C(n, k).
maj@k is the correctness of the majority answer of k samples, answers compared after
`math_score.normalize` (ties go to the answer seen first), averaged over every subset of k of
the n samples when there are at most `MAJ_EXACT_SUBSETS` of them, else over `MAJ_BOOTSTRAP`
random subsets without replacement (seeded): `maj_method` says which. verl's validation
draws its subsets with replacement; an exact expectation needs no seed.
"""
from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from typing import Sequence

from dapo_megatron.reward.math_score import normalize

MAJ_EXACT_SUBSETS = 20000
MAJ_BOOTSTRAP = 1000


def ks_for(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    out = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return out if out[-1] == n else out + [n]


def pass_at_k(n: int, correct: int, k: int) -> float:
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= correct ({correct}) <= n ({n}) and 1 <= k ({k}) <= n")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def majority_correct(answers: Sequence[str], correct: Sequence[bool]) -> bool:
    """Whether the most frequent answer (ties: the one seen first) is correct. An empty answer
    (none extracted) never wins while another answer exists."""
    counts = Counter(a for a in answers if a)
    if not counts:
        return False
    best = max(counts.values())
    winner = next(a for a in answers if a and counts[a] == best)
    return bool(correct[answers.index(winner)])


def maj_at_k(answers: Sequence[str], correct: Sequence[bool], k: int, seed: int = 0) -> tuple[float, str]:
    """(mean majority correctness over subsets of k of the samples, "exact" | "bootstrap")."""
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k ({k}) <= n ({n})")
    if math.comb(n, k) <= MAJ_EXACT_SUBSETS:
        subsets, method = itertools.combinations(range(n), k), "exact"
    else:
        rng = random.Random(seed)
        subsets, method = (sorted(rng.sample(range(n), k)) for _ in range(MAJ_BOOTSTRAP)), "bootstrap"
    total = count = 0
    for idx in subsets:
        total += majority_correct([answers[i] for i in idx], [correct[i] for i in idx])
        count += 1
    return total / count, method


def group_metrics(answers: Sequence[str], correct: Sequence[bool], seed: int = 0) -> dict[str, float]:
    """One prompt's samples -> avg@n, pass@k, maj@k for every k of `ks_for(n)`."""
    n, c = len(correct), sum(bool(x) for x in correct)
    answers = [normalize(a) if a else "" for a in answers]
    out = {f"avg@{n}": c / n}
    for k in ks_for(n):
        out[f"pass@{k}"] = pass_at_k(n, c, k)
        out[f"maj@{k}"], _ = maj_at_k(answers, correct, k, seed)
    return out


def maj_method(n: int) -> str:
    return "exact" if all(math.comb(n, k) <= MAJ_EXACT_SUBSETS for k in ks_for(n)) else "bootstrap"


def mean_by_source(rows: Sequence[tuple[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """(data_source, one prompt's metrics) rows -> {source and "all": {metric: mean over prompts}}."""
    table: dict[str, dict[str, list[float]]] = {}
    for source, metrics in rows:
        for s in (source, "all"):
            for k, v in metrics.items():
                table.setdefault(s, {}).setdefault(k, []).append(v)
    return {s: {k: sum(vs) / len(vs) for k, vs in cols.items()} for s, cols in table.items()}


def validation_metrics(prompts: Sequence[tuple[str, Sequence[str], Sequence[bool]]], seed: int = 0) -> dict:
    """The training loop's validation at n > 1 samples per prompt: (data_source, answers, correct)
    per prompt -> ours (`val/acc/mean@n`, `val/pass@k`, `val/maj@k` over all prompts, `/<source>`
    per source) and verl's (`val-core/<source>/acc/{mean@n, best@n/mean, maj@n/mean}`, the smaller
    k under `val-aux/`). verl's best@k is a bootstrap of the best of k samples; here it is the
    unbiased pass@k, the value that bootstrap estimates."""
    means = mean_by_source([(src, group_metrics(answers, correct, seed)) for src, answers, correct in prompts])
    out: dict[str, float] = {}
    for source, metrics in means.items():
        for name, value in metrics.items():
            kind, k = name.split("@")
            ours = f"val/acc/mean@{k}" if kind == "avg" else f"val/{kind}@{k}"
            out[ours if source == "all" else f"{ours}/{source}"] = value
            if source != "all":
                section = "val-core" if all(int(k) >= int(m.split("@")[1]) for m in metrics) else "val-aux"
                verl = {"avg": f"mean@{k}", "pass": f"best@{k}/mean", "maj": f"maj@{k}/mean"}[kind]
                out[f"{section}/{source}/acc/{verl}"] = value
    return out
