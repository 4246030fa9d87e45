"""Memory over a long run: what the data plane holds, and every process's RSS step by step.

    python bench/data_plane_memory.py [--steps 2000] [--every 200] [--after 100] [--plot PATH]
                                      [--dynamic-sampling] [--save PATH] [--segment 500] [key=value ...]
    python bench/data_plane_memory.py --samples PATH [--steps N] [--after 100] [--every 200] [--plot PATH]

Runs the quickstart as a user does (`python -m dapo_megatron.main`; no validation or
checkpoints; dynamic sampling off unless `--dynamic-sampling`: as the tiny model learns, its
groups turn all-correct and the rounds per step grow, 1 -> 10 and 1.4 -> 8 s a step by step 400,
so thousands of steps would take hours, and a step's work would not be constant) and samples every 2 s the resident memory (RSS) of each role of its
process tree: the driver, the rollout manager, TransferQueue's controller and storage units, the
engine, the training ranks, Ray's GCS and raylet. Prints, every `--every` steps, the RSS of each
role and `data_plane/resident_mb` (bytes still stored after the step's clear: 0 when every step's
rows were cleared), then each role's slope (kB per step, least squares over the steps after
`--after`): flat within noise means nothing accumulates; and the slope of each `--segment` steps
(a trend keeps its sign from segment to segment). The same again for the samples taken right
after each step is logged (every role at the same phase of its step: the engine and the ranks
swing tens of MB inside one), and their mean by segment with the slope from the first segment's
mean to the last's (a heap's slow swings tilt a least-squares slope; a trend moves the means).
Last, each role's RSS at each step's end split by kind of page (/proc/<pid>/status: anonymous,
file-backed, shared memory, i.e. the object store's pages it touched): which kind a rise is.
`--plot`: RSS against step (those at each step's end), as PNG.
`--samples`: no run, the slopes of the samples an earlier run saved (`--save`; a long run that
died still has them).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import NO_EVAL, median, read_metrics, run_main  # noqa: E402  (bench/ is not a package)
from process_memory import TreeSampler, role  # noqa: E402
from results import Table, write  # noqa: E402

# The three kinds of resident page in /proc/<pid>/status: a heap that keeps more grows RssAnon;
# code paged in as new paths run grows RssFile; the object store's pages a process has read or
# written (Ray maps the whole store, its pages count once touched) grow RssShmem.
KINDS = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
ROLES = {"driver": "driver", "ray::RolloutManager": "rollout manager", "ray::TransferQueueController": "TQ controller",
         "ray::SimpleStorageUnit": "TQ storage", "ray::EngineActor": "engine", "ray::TrainWorker": "training ranks",
         "gcs_server": "Ray GCS", "raylet": "raylet"}


class RssByStep(TreeSampler):
    """step -> {role: summed RSS MB}. `by_step`: the last sample taken while that many steps were
    logged, one every `every_s` (any phase of a step: the engine's and the ranks' heaps swing tens
    of MB inside one). `at_end`: the first sample after step s was logged (within `poll_s`), so
    every role at the same phase of every step: the engine just past its weight update's heap
    hand-back and starting the next step's requests, the ranks idle until its batch comes."""

    def __init__(self, root: int, metrics: str, every_s: float = 2.0, save: str = "", poll_s: float = 0.25):
        super().__init__(root, poll_s)
        self.metrics, self.interval_s, self.save, self.reads = metrics, every_s, save, 0
        self.by_step, self.at_end = {}, {}
        self.logged, self.offset, self.last = 0, 0, 0.0

    def _logged(self) -> int:
        """Complete lines of metrics.jsonl, read on from where the last call stopped (it only grows)."""
        try:
            with open(self.metrics, "rb") as f:
                f.seek(self.offset)
                new = f.read()
        except FileNotFoundError:
            return 0
        complete = new.rfind(b"\n") + 1
        self.logged += new[:complete].count(b"\n")
        self.offset += complete
        return self.logged

    def read(self, procs: list[psutil.Process]) -> None:
        before = self.logged
        step, now = self._logged(), time.monotonic()
        due, ended = now - self.last >= self.interval_s, step != before
        if not (due or ended):
            return
        rss = collections.defaultdict(float)
        for p in procs:
            name = ROLES.get(role(p))
            if name is None:
                continue
            try:
                rss[name] += p.memory_info().rss / 2**20
                if ended:
                    for kind, mb in page_kinds(p.pid).items():
                        rss[f"{name}: {kind}"] += mb
            except (psutil.Error, OSError):
                pass
        if due:  # its own clock, so that these stay at random phases of the steps
            self.by_step[step], self.last = {n: mb for n, mb in rss.items() if ":" not in n}, now
        if ended:
            self.at_end[step] = dict(rss)
        self.reads += 1
        if self.save and self.reads % 50 == 0:  # what a long run has sampled survives its end
            with open(self.save, "w") as f:
                json.dump({"by_step": self.by_step, "at_end": self.at_end}, f)


def page_kinds(pid: int) -> dict[str, float]:
    """kind -> MB resident of that kind, from /proc/<pid>/status (kB there)."""
    with open(f"/proc/{pid}/status") as f:
        fields = [line.split() for line in f]
    return {KINDS[w[0]]: int(w[1]) / 1024 for w in fields if w and w[0] in KINDS}


def slope_kb(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (step, MB) in kB per step."""
    n = len(points)
    if n < 2:
        return float("nan")
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var * 1024 if var else float("nan")


def slopes_by(by_step: dict, names: list[str], after: int, every: int) -> list[tuple[str, dict]]:
    """(label, role -> points) to fit: every sample after `after`, and the lowest and the highest
    sample of each `every`-step window. A role whose RSS swings inside a step (the engine hands
    its free heap pages back after each push) is sampled at random phases of it; its window floor
    and peak still each show a trend."""
    later = sorted((s, r) for s, r in by_step.items() if s > after)
    windows = collections.defaultdict(list)
    for s, r in later:
        windows[(s - after - 1) // every].append(r)
    def per_window(pick):
        return {n: [(after + (w + 0.5) * every, pick(r[n] for r in rs if n in r))
                    for w, rs in sorted(windows.items()) if any(n in r for r in rs)] for n in names}
    return [("all", {n: [(s, r[n]) for s, r in later if n in r] for n in names}),
            (f"lowest of each {every} steps", per_window(min)), (f"highest of each {every} steps", per_window(max))]


def segments(samples: dict, names: list[str], after: int, segment: int):
    """((first step, last step), role -> [(step, MB)]) of each `segment` steps after `after`."""
    last = max(samples)
    for a in range(after, last, segment):
        b = min(a + segment, last)
        yield (a, b), {n: [(s, r[n]) for s, r in samples.items() if a < s <= b and n in r] for n in names}


def segment_slopes(by_step: dict, names: list[str], after: int, segment: int) -> list[tuple[str, dict]]:
    """(label, role -> slope kB/step) of each `segment` steps after `after`: a trend keeps its sign
    from segment to segment, a heap's slow swings (fragmentation, filled and emptied) change it."""
    return [(f"steps {a + 1}-{b}", {n: slope_kb(p) for n, p in points.items()})
            for (a, b), points in segments(by_step, names, after, segment)]


def print_slopes(by_step: dict, at_end: dict, after: int, every: int, segment: int) -> None:
    names = [n for n in ROLES.values() if any(n in r for r in by_step.values())]
    print(f"\nslope after step {after} (kB per step; target < 1)")
    print("| samples | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 1))
    for label, points in slopes_by(by_step, names, after, every):
        print(f"| {label} | " + " | ".join(f"{slope_kb(points[n]):.2f}" for n in names) + " |")
    for label, slopes in segment_slopes(by_step, names, after, segment):
        print(f"| {label} | " + " | ".join(f"{slopes[n]:.2f}" for n in names) + " |")
    if not at_end:  # samples saved before the bench took them at each step's end
        return
    later = slopes_by(at_end, names, after, every)[0][1]  # its "all": every sample after `after`
    print(f"| at each step's end, {sum(s > after for s in at_end)} steps | "
          + " | ".join(f"{slope_kb(later[n]):.2f}" for n in names) + " |")
    for label, slopes in segment_slopes(at_end, names, after, segment):
        print(f"| at each step's end, {label} | " + " | ".join(f"{slopes[n]:.2f}" for n in names) + " |")
    # A heap that swings slowly (tens of MB over a hundred steps) tilts a least-squares slope by
    # about its swing over the window's length; the mean of each segment moves only with a trend.
    means = segment_means(at_end, names, after, segment)
    print(f"\nmean RSS (MB) at each step's end, by {segment} steps")
    print("| steps | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 1))
    for (a, b), m in means:
        print(f"| {a + 1}-{b} | " + " | ".join(f"{m[n]:.1f}" for n in names) + " |")
    if len(means) > 1:
        print("| first -> last mean, kB per step | " + " | ".join(f"{kb:.2f}" for kb in drift(means, names)) + " |")
    print_kinds(at_end, names, after, segment)


def drift(means: list, names: list[str]) -> list[float]:
    """kB per step from the first segment's mean to the last's, by name."""
    ((a0, b0), first), ((a1, b1), last) = means[0], means[-1]
    span = (a1 + b1 - a0 - b0) / 2
    return [(last[n] - first[n]) * 1024 / span for n in names]


def print_kinds(at_end: dict, names: list[str], after: int, segment: int) -> None:
    """Each role's RSS at each step's end by kind of page: which kind a rise is."""
    split = [f"{n}: {k}" for n in names for k in KINDS.values() if any(f"{n}: {k}" in r for r in at_end.values())]
    if not split:  # samples saved before the bench split them
        return
    later = slopes_by(at_end, split, after, segment)[0][1]
    means = segment_means(at_end, split, after, segment)
    print(f"\nRSS at each step's end by kind of page (MB at the last step; kB per step after step {after})")
    print("| role: kind | last | slope | first -> last mean of each " + str(segment) + " steps |\n|---|---|---|---|")
    last = at_end[max(at_end)]
    for n, kb in zip(split, drift(means, split) if len(means) > 1 else [float("nan")] * len(split)):
        print(f"| {n} | {last.get(n, float('nan')):.1f} | {slope_kb(later[n]):.2f} | {kb:.2f} |")


def segment_means(samples: dict, names: list[str], after: int, segment: int) -> list[tuple[tuple[int, int], dict]]:
    """((first step, last step), role -> mean MB) of each `segment` steps after `after`."""
    return [(span, {n: sum(mb for _, mb in p) / max(len(p), 1) for n, p in points.items()})
            for span, points in segments(samples, names, after, segment)]


def load_samples(path: str, steps: int) -> tuple[dict, dict]:
    """(by_step, at_end) of a `--save` file, steps < `steps` (a file from before `at_end` has none)."""
    with open(path) as f:
        saved = json.load(f)
    parts = (saved["by_step"], saved["at_end"]) if "by_step" in saved else (saved, {})
    return tuple({int(s): r for s, r in part.items() if int(s) < steps} for part in parts)


def plot(by_step: dict, path: str, steps: int, when: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    for name in ROLES.values():
        points = [(s, r[name]) for s, r in sorted(by_step.items()) if name in r and s > 0]
        if points:
            ax.plot(*zip(*points), label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("RSS (MB)")
    ax.set_title(f"quickstart, {steps} steps: RSS of each role{when}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=200)
    p.add_argument("--after", type=int, default=100, help="slopes over the steps after this one")
    p.add_argument("--plot", default="", help="write RSS against step to this PNG")
    p.add_argument("--dynamic-sampling", action="store_true", help="keep algorithm.filter_groups on")
    p.add_argument("--save", default="", help="write the samples (step -> RSS MB by role) here as they come")
    p.add_argument("--segment", type=int, default=500, help="also the slope of each this many steps after --after")
    p.add_argument("--samples", default="", help="no run: the slopes of samples a run wrote with --save")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.samples:
        by_step, at_end = load_samples(args.samples, args.steps)
        print_slopes(by_step, at_end, args.after, args.every, args.segment)
        if args.plot:
            plot(at_end or by_step, args.plot, max(by_step), ", at each step's end" if at_end else "")
        return
    with tempfile.TemporaryDirectory() as out:
        samplers = []

        def start(proc) -> None:
            samplers.append(RssByStep(proc.pid, os.path.join(out, "metrics.jsonl"), save=args.save))
            samplers[0].start()
        try:
            run_main("quickstart", [f"trainer.total_training_steps={args.steps}", *NO_EVAL,
                                    f"algorithm.filter_groups.enable={args.dynamic_sampling}".lower(), *args.overrides],
                     out_dir=out, on_start=start)
        finally:
            for sampler in samplers:
                sampler.stop.set()
                sampler.join()
        rows = read_metrics(out)
    # Samples taken once every step was logged see the run shutting down: left out.
    by_step = {s: r for s, r in sampler.by_step.items() if s < args.steps}
    at_end = {s: r for s, r in sampler.at_end.items() if s < args.steps}
    names = [n for n in ROLES.values() if any(n in r for r in by_step.values())]
    print(f"\nRSS (MB) of each role over {args.steps} quickstart steps")
    head = ("step", "data_plane/resident_mb", *names, "step s")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        s = r["step"]
        if s == 1 or s % args.every == 0:  # the sample at that step's end, else the nearest one
            near = at_end.get(s) or by_step[min(by_step, key=lambda k: abs(k - s))]
            cells = [f"{near.get(n, float('nan')):.1f}" for n in names]
            print(f"| {s} | {r['data_plane/resident_mb']:.3f} | " + " | ".join(cells) + f" | {r['timing/step']:.2f} |")
    times = [r["timing/step"] for r in rows if r["step"] > args.after]
    if times:
        print(f"\nmedian step after step {args.after}: {median(times):.3f} s")
    print_slopes(by_step, at_end, args.after, args.every, args.segment)
    if args.plot:
        plot(at_end or by_step, args.plot, args.steps, ", at each step's end" if at_end else "")
        print(f"\nplot: {args.plot}")
    write_results(args, rows, by_step, at_end, names)


def write_results(args, rows: list[dict], by_step: dict, at_end: dict, names: list[str]) -> None:
    """The slopes table: each role's RSS every `--every` steps, and its slope after `--after`."""
    table = []
    for r in rows:
        s = r["step"]
        if s % args.every == 0:
            near = at_end.get(s) or by_step[min(by_step, key=lambda k: abs(k - s))]
            table.append([str(s), f"{r['data_plane/resident_mb']:.3f}", *(f"{near.get(n, float('nan')):.1f}" for n in names)])
    every = slopes_by(by_step, names, args.after, args.every)[0][1]
    ends = slopes_by(at_end, names, args.after, args.every)[0][1] if at_end else {}
    table.append([f"slope after step {args.after}, kB / step: every 2 s / at each step's end", "",
                  *(f"{slope_kb(every[n]):.2f} / " + (f"{slope_kb(ends[n]):.2f}" if n in ends else "-") for n in names)])
    write("data_plane_memory", title="Memory over a long run",
          measures="The quickstart run as a user runs it: what the data plane holds after each step, and the RSS of "
                   "every role step by step, with each role's slope (kB a step) after the warm-up.",
          tables=[Table("slopes", f"RSS (MB) of each role every {args.every} steps and its slopes (kB a step): "
                        f"{args.steps} quickstart steps, dynamic sampling {'on' if args.dynamic_sampling else 'off'}",
                        ["step", "data plane holds (MB)", *names], table)],
          plots=[args.plot] if args.plot else [])


if __name__ == "__main__":  # Ray and vLLM may spawn processes: the guard keeps them from re-running this
    main()
