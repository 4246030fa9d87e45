"""Throughput of the training modes on one layout: sync, one_step_off, async (staleness 1 and 2,
pushes reaching responses mid-generation or draining them first), and the modes
trainer.deterministic allows with it on, alternated in one run.

    python bench/async_throughput.py [--rounds 2] [--steps 36] [--plot bench/plots/async_modes.png] [key=value ...]

Runs `quickstart_async` (split placement on the two cores: one training rank, one engine, the
same threads in every mode; dynamic sampling on, early stop, as shipped) once per mode per round,
each round with its own seed (data.seed, rollout.seed). Per run, over steps 3.. (two warm-up
steps): samples/s and kept tokens/s (kept responses and their tokens over the steps' wall time),
the median step, the engine's idle share (no collection running), the policy lag and partial
share, the cores each role used (CPU seconds over the window's wall seconds, read from /proc every
0.5 s), and the sampled reward (`reward/mean`, before dynamic sampling) over the first and last
third of the steps: the same number of samples in every mode. Ratios are against sync in the same
round; the noise is the spread between rounds of one mode. Two more tables: the mode to run on one
machine (`recommendation`: the fastest that learns per sample as sync does) and
trainer.deterministic's cost per mode. `--plot`: reward against wall-clock
time and against samples trained, per mode (PNG).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, read_metrics  # noqa: E402  (bench scripts sit side by side, not in a package)
from process_memory import TreeSampler, run_sampled  # noqa: E402
from results import Table, write  # noqa: E402

CONFIG = "quickstart_async"
MODES = {  # name -> overrides of quickstart_async (shipped: async, max_staleness 2, partial rollouts)
    "sync": ["trainer.mode=sync", "trainer.max_staleness=1"],
    "one_step_off": ["trainer.mode=one_step_off", "trainer.max_staleness=1"],
    "async k=1": ["trainer.max_staleness=1"],
    "async k=2": [],
    "async k=2 drain": ["trainer.partial_rollout=false"],
}
# trainer.deterministic's cost: each mode it allows, again with it on (early stop in waves; async
# k=1's partial rollouts in segments; k=2's would wait behind the validation: refused)
DETERMINISTIC = " deterministic"
MODES.update({m + DETERMINISTIC: o + ["trainer.deterministic=true"]
              for m, o in list(MODES.items()) if m in ("sync", "one_step_off", "async k=1", "async k=2 drain")})
ROLES = {"driver": "driver", "ray::EngineActor": "engine", "ray::TrainWorker": "rank", "ray::RolloutManager": "manager"}
WARMUP = 2


class CpuSampler(TreeSampler):
    """(time, pid -> CPU seconds so far) of the run's process tree, every `every_s`."""

    def __init__(self, root: int, every_s: float = 0.5):
        super().__init__(root, every_s)
        self.samples: list[tuple[float, dict[int, float]]] = []

    def read(self, procs: list[psutil.Process]) -> None:
        now: dict[int, float] = {}
        for p in procs:
            try:
                t = p.cpu_times()
                now[p.pid] = t.user + t.system
            except psutil.Error:
                continue
        self.samples.append((time.time(), now))

    def cores(self, start: float, end: float) -> dict[str, float]:
        """Role -> CPU seconds per wall second between `start` and `end` (the nearest samples)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return {}
        (t0, a), (t1, b) = inside[0], inside[-1]
        out: dict[str, float] = collections.defaultdict(float)
        for pid, cpu in b.items():
            name = self.names.get(pid, "?")
            out[ROLES.get(name, "other")] += (cpu - a.get(pid, 0.0)) / (t1 - t0)
        return dict(out)


def run_mode(overrides: list[str], out: str, steps: int, seed: int) -> dict:
    # dynamic sampling as shipped (process_memory's runner turns it off)
    sampler = run_sampled(CONFIG, steps, ["algorithm.filter_groups.enable=true", f"data.seed={seed}",
                                          f"rollout.seed={seed}", *overrides], out, CpuSampler)
    rows = read_metrics(out)
    phases = [json.loads(line) for line in open(os.path.join(out, "phases.jsonl"))]
    start = min(p["end"] - p["s"] for p in phases if p["step"] == WARMUP + 1)
    end = max(p["end"] for p in phases)
    return {"rows": rows, "cores": sampler.cores(start, end)}


def summary(result: dict, samples_per_step: int) -> dict:
    rows = result["rows"]
    timed = rows[WARMUP:]
    wall = sum(r["timing/step"] for r in timed)
    third = max(len(rows) // 3, 1)
    mean = lambda rs, k: statistics.fmean(r.get(k, 0.0) for r in rs)  # noqa: E731
    return {"samples/s": samples_per_step * len(timed) / wall,
            "tokens/s": sum(r["sampling/kept_tokens"] for r in timed) / wall,
            "step_s": median(timed, "timing/step"),
            "engine_idle": mean(timed, "timing/engine_idle_frac"),
            "trainer_wait": mean(timed, "timing/trainer_wait") + mean(timed, "timing/gen"),
            "lag": mean(timed, "rollout/staleness_mean"), "partial": mean(timed, "rollout/partial_frac"),
            "reward_first": mean(rows[:third], "reward/mean"), "reward_last": mean(rows[-third:], "reward/mean"),
            "carried": [r.get("sampling/carried_groups", 0.0) for r in timed],
            "cores": result["cores"]}


def plot(results: dict, samples_per_step: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_time, by_samples) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for i, (mode, runs) in enumerate(results.items()):
        for j, res in enumerate(runs):
            rows = res["rows"]
            clock, t = [], 0.0
            for r in rows:
                t += r["timing/step"]
                clock.append(t)
            reward = [r["reward/mean"] for r in rows]
            smooth = [statistics.fmean(reward[max(0, k - 4):k + 1]) for k in range(len(reward))]
            label = mode if j == 0 else None
            by_time.plot(clock, smooth, color=f"C{i}", alpha=0.9 - 0.3 * j, label=label)
            by_samples.plot([samples_per_step * r["step"] for r in rows], smooth, color=f"C{i}", alpha=0.9 - 0.3 * j)
    by_time.set(xlabel="wall-clock seconds (sum of step times; step 1 waits for the engine's warm-up)", ylabel="sampled reward (5-step mean)")
    by_samples.set(xlabel="responses trained")
    by_time.legend(fontsize=8)
    fig.suptitle(f"{CONFIG}: one training rank + one engine on 2 cores; a line per mode and seed")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    p.add_argument("--plot", default="", help="write the reward curves here (PNG)")
    p.add_argument("--save", default="", help="write every run's metrics rows here (JSON)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    from dapo_megatron.config import load_config
    cfg = load_config(CONFIG, args.overrides)
    samples_per_step = cfg.data.train_batch_size * cfg.rollout.n
    modes = args.modes.split(",")
    results: dict[str, list] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for m in modes:
                out = os.path.join(tmp, f"{r}-{m.replace(' ', '_').replace('=', '')}")
                results[m].append(run_mode(MODES[m] + args.overrides, out, args.steps, seed=r + 1))
                print(f"round {r + 1}, {m}: done", flush=True)
    if args.save:
        json.dump(results, open(args.save, "w"))
    if args.plot:
        plot(results, samples_per_step, args.plot)
    table = {m: [summary(res, samples_per_step) for res in runs] for m, runs in results.items()}
    base = table.get("sync")
    print(f"\n{CONFIG}, {args.steps} steps x {args.rounds} rounds (seeds 1..{args.rounds}), {samples_per_step} "
          f"responses a step; steps {WARMUP + 1}..; per round: value (ratio to sync's samples/s in that round)")
    print("| mode | samples/s | kept tokens/s | median step (s) | trainer wait (s) | engine idle | lag | partial "
          "| cores: rank / engine / manager / driver / other | reward first third -> last third |")
    print("|" + "---|" * 10)
    for m, rounds in table.items():
        cells = []
        for key in ("samples/s", "tokens/s", "step_s", "trainer_wait", "engine_idle", "lag", "partial"):
            vals = [s[key] for s in rounds]
            text = " / ".join(f"{v:.2f}" for v in vals)
            if key == "samples/s" and base:
                text += " (" + " / ".join(f"{v / b['samples/s']:.2f}x" for v, b in zip(vals, base)) + ")"
            cells.append(text)
        cores = " ; ".join(" / ".join(f"{s['cores'].get(k, 0.0):.2f}" for k in ("rank", "engine", "manager", "driver",
                                                                                 "other")) for s in rounds)
        reward = " ; ".join(f"{s['reward_first']:.3f} -> {s['reward_last']:.3f}" for s in rounds)
        print(f"| {m} | " + " | ".join(cells) + f" | {cores} | {reward} |")
    write_results(args, table, samples_per_step)


def recommendation(table: dict) -> Table:
    """The one-machine recommendation, by a rule fixed before the run: the fastest mode (mean of
    its rounds' samples/s ratios to sync) whose learning per sample, the sampled reward's gain from
    the first third to the last (the same samples in every mode), is sync's mean gain within
    sync's own seed spread (its rounds' max - min)."""
    gain = lambda s: s["reward_last"] - s["reward_first"]  # noqa: E731
    sync = [gain(s) for s in table["sync"]]
    centre, spread = statistics.fmean(sync), max(sync) - min(sync)
    rows, ratios = [], {}
    for m, rounds in table.items():
        ratio = statistics.fmean(s["samples/s"] / b["samples/s"] for s, b in zip(rounds, table["sync"]))
        g = statistics.fmean(gain(s) for s in rounds)
        learns = abs(g - centre) <= spread
        if learns:
            ratios[m] = ratio
        rows.append([m, f"{ratio:.2f}x", " / ".join(f"{gain(s):+.3f}" for s in rounds), f"{g:+.3f}",
                     f"{g - centre:+.3f}", "yes" if learns else "no"])
    best = max(ratios, key=ratios.get)
    for row in rows:
        row.append("**recommended**" if row[0] == best else "")
    return Table("recommend", "The mode to run on one machine: the fastest whose learning per sample is sync's "
                 "within sync's seed spread", ["mode", "samples/s vs sync (mean)", "reward gain per round",
                                               "mean gain", "vs sync's mean", "learns as sync", "verdict"], rows,
                 note=f"Gain: the sampled reward's last third minus its first third (the same samples in every mode). "
                      f"Sync's mean gain {centre:+.3f}, its seed spread {spread:.3f}: a mode learns as sync does "
                      "when its mean gain is within that spread of sync's.")


def write_results(args, table: dict, samples_per_step: int) -> None:
    """The modes table: each cell its rounds' values, round 1 / round 2 / ..."""
    def each(rounds, fmt) -> str:
        return " / ".join(fmt(s) for s in rounds)
    base, rows = table.get("sync"), []
    for m, rounds in table.items():
        rate = each(rounds, lambda s: f"{s['samples/s']:.1f}")
        if base:
            rate += " (" + " / ".join(f"{s['samples/s'] / b['samples/s']:.2f}x" for s, b in zip(rounds, base)) + ")"
        carried = each(rounds, lambda s: f"{min(s['carried']):.0f}-{max(s['carried']):.0f}" if any(s["carried"]) else "-")
        rows.append([m, rate, each(rounds, lambda s: f"{s['step_s']:.2f}"), each(rounds, lambda s: f"{s['trainer_wait']:.2f}"),
                     each(rounds, lambda s: f"{s['engine_idle']:.2f}"), each(rounds, lambda s: f"{s['lag']:.2f}"),
                     each(rounds, lambda s: f"{s['partial']:.2f}"), carried,
                     each(rounds, lambda s: f"{s['cores'].get('rank', 0.0):.2f} / {s['cores'].get('engine', 0.0):.2f}"),
                     " ; ".join(f"{s['reward_first']:.3f} -> {s['reward_last']:.3f}" for s in rounds)])
    tables = [Table("modes", f"Each mode on {CONFIG}'s layout, {args.rounds} rounds x {args.steps} steps, steps "
                    f"{WARMUP + 1}-{args.steps}, {samples_per_step} responses a step; each cell its rounds (seeds 1.."
                    f"{args.rounds}) in order, "
                    "ratio to sync", ["mode", "samples/s", "median step (s)", "trainer wait (s)", "engine idle",
                                      "lag (pushes)", "partial", "groups carried", "cores: rank / engine",
                                      "sampled reward, first third -> last third"], rows)]
    if base and len(base) > 1:
        tables.append(recommendation(table))
    paired = [m for m in table if m.endswith(DETERMINISTIC) and m[:-len(DETERMINISTIC)] in table]
    if paired:
        tables.append(Table("deterministic", "trainer.deterministic's cost: each mode with it on against the same "
                            "mode off, round by round", ["mode", "samples/s, default", "samples/s, deterministic",
                                                         "ratio", "median step (s), default / deterministic"],
                            [[m[:-len(DETERMINISTIC)], each(table[m[:-len(DETERMINISTIC)]], lambda s: f"{s['samples/s']:.1f}"),
                              each(table[m], lambda s: f"{s['samples/s']:.1f}"),
                              " / ".join(f"{d['samples/s'] / b['samples/s']:.2f}x"
                                         for d, b in zip(table[m], table[m[:-len(DETERMINISTIC)]])),
                              " ; ".join(f"{b['step_s']:.2f} / {d['step_s']:.2f}"
                                         for d, b in zip(table[m], table[m[:-len(DETERMINISTIC)]]))] for m in paired]))
    write("async_throughput", title="Training modes on one layout",
          measures="sync, one_step_off and async (staleness 1 and 2, partial rollouts or drained) alternated on "
                   "`quickstart_async`'s layout, a seed per round: samples/s, the step, the engine's idle share, the "
                   "policy lag, the cores each role used and the sampled reward.",
          tables=tables,
          plots=[args.plot] if args.plot else [])


if __name__ == "__main__":
    main()
