"""Reward scoring throughput: RewardPool on all cores vs bare math-verify in one process.

    python bench/reward_throughput.py [--items 2000] [--workers 0] [--timeout-s 2] [--adversarial 0.01]

The mix imitates DAPO rollouts: groups of `--group` responses per ground truth (integers,
fractions, decimals, radicals, expressions), ~1-3k characters of reasoning, then the answer as an
"Answer:" line or a \\boxed{}, equivalent notations and ~45% wrong answers; plus `--adversarial`
of the items: 1000-deep nesting, megabyte strings, \\boxed{10^{10^{10}}}, and nested tangents that
pass every cap yet take ~18 s in sympy (only the deadline stops them).

Baseline ("bare"): `math_score.score` in this process, math-verify timeouts disabled, on the
clean items only: the adversarial ones would hang it (math-verify's own alarm timeouts would be
the alternative, but they cost 5 s per hit and only work in a main thread). The pool runs the same
clean items (same-work ratio) and then another mix of the same size with the adversarial items.
"bare, n processes" splits the clean items over n independent bare processes started together:
the ceiling of any process-parallel scheme on this machine at this moment (on a shared VM it can
be far below n x). "cpu ms/a" is CPU time per answer (parent + workers); it too rises when
processes run side by side (shared caches, other tenants).
"""
from __future__ import annotations

import argparse
import os
import random
import time

from common import median
from results import Table, write

FILLER = ("We substitute and simplify the expression step by step . Note that the constraint "
          "gives us a relation between the terms , so we check each case carefully .").split()


def _problem(rng: random.Random) -> tuple[str, list[str], list[str]]:
    """(gold, equivalent predictions, wrong predictions) for one random problem."""
    a, b = rng.randint(2, 99), rng.randint(2, 9)
    kind = rng.choice(["int", "int", "int", "frac", "decimal", "radical", "expr"])
    if kind == "int":
        n = rng.randint(0, 10_000)
        return str(n), [str(n), f"{n}.0", f"{n:,}"], [str(n + 1), str(n * 2 + 3)]
    if kind == "frac":
        return f"\\frac{{{a}}}{{{a * b + 1}}}", [f"{a}/{a * b + 1}", f"\\dfrac{{{a}}}{{{a * b + 1}}}"], \
            [f"\\frac{{{a + 1}}}{{{a * b + 1}}}", f"{a}/{a * b}"]
    if kind == "decimal":
        return f"{a}.5", [f"\\frac{{{2 * a + 1}}}{{2}}", f"{2 * a + 1}/2"], [f"{a}.05", f"{a + 1}.5"]
    if kind == "radical":
        return f"\\frac{{{a}\\sqrt{{{b}}}}}{{2}}", [f"{a}\\sqrt{{{b}}}/2", f"\\frac{{{a}}}{{2}}\\sqrt{{{b}}}"], \
            [f"{a}\\sqrt{{{b + 1}}}/2", f"\\frac{{{a}\\sqrt{{{b}}}}}{{3}}"]
    return f"{a}x^2+{b}x", [f"{b}x+{a}x^2", f"x({a}x+{b})"], [f"{a}x^2-{b}x", f"{a}x+{b}"]


def _response(rng: random.Random, answer: str) -> str:
    reasoning = " ".join(rng.choice(FILLER) for _ in range(rng.randint(150, 500)))
    fmt = rng.choice(["Answer: {}", "Answer: ${}$", "The answer is $\\boxed{{{}}}$.", "\\boxed{{{}}}"])
    return reasoning + "\n\n" + fmt.format(answer)


ADVERSARIAL = [
    ("Answer: " + "{" * 1000 + "1" + "}" * 1000, "1"),
    ("9" * 1_000_000 + "\nAnswer: " + "(" * 5000, "9"),
    ("Thus \\boxed{10^{10^{10}}}", "1"),
    ("Answer: \\tan(\\tan(\\tan(\\tan(\\tan(1)))))", "3"),
]


def make_mix(items: int, group: int, adversarial: float, seed: int) -> tuple[list, list, list[bool]]:
    rng = random.Random(seed)
    responses, truths = [], []
    while len(responses) < items:
        gold, right, wrong = _problem(rng)
        for _ in range(group):
            responses.append(_response(rng, rng.choice(right if rng.random() < 0.55 else wrong)))
            truths.append(gold)
    responses, truths = responses[:items], truths[:items]
    is_adv = [False] * items
    for k, i in enumerate(rng.sample(range(items), round(items * adversarial))):
        responses[i], truths[i] = ADVERSARIAL[k % len(ADVERSARIAL)]
        is_adv[i] = True
    return responses, truths, is_adv


def _cpu_seconds(pids: list[int]) -> dict[int, float]:
    """CPU time (user + system) of this process and of each pid, from /proc (Linux)."""
    out = {0: time.process_time()}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return out


def _row(name, wall, cpu, latencies, results, bare_rate=None):
    n = len(results)
    ms = sorted(x * 1e3 for x in latencies)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    timeouts = sum(r.timed_out for r in results)
    refused = sum(r.reason in ("too_long", "too_deep", "huge_power") for r in results)
    ratio = f"{n / wall / bare_rate:.2f}x" if bare_rate else "1.00x"
    cpu_ms = f"{cpu / n * 1e3:.2f}" if cpu is not None else "-"
    line = (f"{name:<26} {n:>6} {n / wall:>10.0f} {ratio:>7} {cpu_ms:>8} "
            f"{median(ms):>7.1f} {p99:>8.1f} {ms[-1]:>8.1f} {timeouts:>8} {refused:>7}")
    return line, {"name": name, "answers_s": n / wall, "ratio": ratio, "p99_ms": p99, "max_ms": ms[-1],
                  "timeouts": timeouts, "refused": refused}


def _bare(responses, truths):
    from dapo_megatron.reward.math_score import score
    results, latencies = [], []
    cpu0, t0 = time.process_time(), time.perf_counter()
    for r, g in zip(responses, truths):
        t = time.perf_counter()
        results.append(score(r, g))
        latencies.append(time.perf_counter() - t)
    return time.perf_counter() - t0, time.process_time() - cpu0, latencies, results


def _bare_slice(barrier, queue, responses, truths, warm_r, warm_t):
    """One of the `--workers` independent bare processes of the "ceiling" row."""
    import logging
    from dapo_megatron.reward.math_score import warm_up
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    warm_up()
    _bare(warm_r, warm_t)
    barrier.wait()
    queue.put(_bare(responses, truths))


def _bare_parallel(n, responses, truths, warm_r, warm_t):
    """n bare processes on interleaved slices, started together: what any process-parallel
    scheme can reach on this machine right now (a shared VM may give far less than n cores)."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_bare_slice, args=(barrier, queue, responses[k::n], truths[k::n],
                                                   warm_r[k::n], warm_t[k::n])) for k in range(n)]
    for proc in procs:
        proc.start()
    parts = [queue.get() for _ in procs]
    for proc in procs:
        proc.join()
    return (max(p[0] for p in parts), sum(p[1] for p in parts), [x for p in parts for x in p[2]],
            [x for p in parts for x in p[3]])


def _pooled(pool, responses, truths):
    """Wall time, CPU of the parent + workers (None when a worker was replaced: a killed
    process's CPU time is gone), latencies, results."""
    before, t0 = _cpu_seconds(pool.pids), time.perf_counter()
    results = pool.score_batch(responses, truths)
    wall, after = time.perf_counter() - t0, _cpu_seconds(pool.pids)
    cpu = sum(v - before[k] for k, v in after.items()) if after.keys() == before.keys() else None
    return wall, cpu, [r.elapsed_s for r in results], results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=2000)
    p.add_argument("--group", type=int, default=8, help="responses per ground truth")
    p.add_argument("--adversarial", type=float, default=0.01, help="fraction of adversarial items")
    p.add_argument("--workers", type=int, default=0, help="0: one per core")
    p.add_argument("--timeout-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=200, help="items scored before timing, per side")
    p.add_argument("--no-ceiling", action="store_true", help="skip the n-independent-processes row")
    args = p.parse_args()

    import logging

    from dapo_megatron.reward.math_score import warm_up
    from dapo_megatron.reward.pool import RewardPool

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    responses, truths, is_adv = make_mix(args.items, args.group, args.adversarial, args.seed)
    clean_r = [r for r, adv in zip(responses, is_adv) if not adv]
    clean_t = [t for t, adv in zip(truths, is_adv) if not adv]
    # Steady state, as in training where the pool outlives steps: both sides first score a
    # different clean mix, so sympy's first-use costs are not in the numbers.
    warm_r, warm_t, _ = make_mix(args.warmup, args.group, 0.0, args.seed + 1)
    warm_up()
    _bare(warm_r, warm_t)
    wall, cpu, latencies, bare = _bare(clean_r, clean_t)
    bare_rate = len(bare) / wall
    rows = [_row("bare, 1 process, clean", wall, cpu, latencies, bare)]
    if not args.no_ceiling:
        n = args.workers or len(os.sched_getaffinity(0))
        rows.append(_row(f"bare, {n} processes, clean", *_bare_parallel(n, clean_r, clean_t, warm_r, warm_t),
                         bare_rate=bare_rate))

    with RewardPool(args.workers, args.timeout_s) as pool:
        pool.score_batch(warm_r, warm_t)
        wall, cpu, latencies, results = _pooled(pool, clean_r, clean_t)
        rows.append(_row(f"pool x{pool.num_workers}, clean", wall, cpu, latencies, results, bare_rate))
        assert [r.acc for r in results] == [r.acc for r in bare], "pool and bare disagree"
        # A fresh mix (other seed): the same items again would hit math-verify's parse caches.
        adv_r, adv_t, _ = make_mix(args.items, args.group, args.adversarial, args.seed + 2)
        wall, cpu, latencies, results = _pooled(pool, adv_r, adv_t)
        rows.append(_row(f"pool x{pool.num_workers}, +{args.adversarial:.0%} adversarial", wall, cpu,
                         latencies, results, bare_rate))
        restarts = pool.restarts

    print(f"{args.items} items ({len(clean_r)} clean), groups of {args.group}, deadline {args.timeout_s} s, "
          f"{os.cpu_count()} cores, 1-min load {os.getloadavg()[0]:.1f}, accuracy of the mix "
          f"{sum(r.acc for r in bare) / len(bare):.2f}, worker restarts {restarts}")
    print(f"{'run':<26} {'items':>6} {'answers/s':>10} {'vs bare':>7} {'cpu ms/a':>8} {'p50 ms':>7} "
          f"{'p99 ms':>8} {'max ms':>8} {'timeouts':>8} {'refused':>7}")
    print("\n".join(line for line, _ in rows))
    figures = [f for _, f in rows]
    adversarial = figures[-1]
    write("reward_throughput", title="Reward scoring throughput",
          measures="RewardPool on all cores against bare math-verify in one process, on a mix imitating DAPO rollouts, "
                   "and the pool's latency with adversarial answers mixed in.",
          tables=[Table("throughput", f"Answers scored per second ({args.items} items, {os.cpu_count()} cores)",
                        ["scorer", "answers/s", "vs bare math-verify, one process"],
                        [[f["name"], round(f["answers_s"]), f["ratio"]] for f in figures[:-1]]),
                  Table("adversarial", f"With {args.adversarial:.0%} adversarial answers, deadline {args.timeout_s:g} s",
                        ["p99 latency", "worst latency", "deadline"],
                        [[f"{adversarial['p99_ms']:.0f} ms", f"{adversarial['max_ms'] / 1e3:.1f} s",
                          f"{args.timeout_s:g} s"]])],
          extra={"runs": figures, "worker_restarts": restarts})


if __name__ == "__main__":
    main()
