"""Cores each process of the quickstart uses in each phase of a step: what is left idle.

    python bench/core_use.py [--steps 12] [--config quickstart] [--every 0.1] [key=value ...]

Runs the quickstart (dynamic sampling off, no validation or checkpoints, plus any overrides) and
reads, every `--every` s, the CPU time of every thread of every process of its tree
(/proc/<pid>/task/<tid>/stat). The driver's `phases.jsonl` says when each phase of each step ran
(its wall-clock end and length); every interval between two readings is charged to the phase its
middle falls in ("between phases": the driver's own work between them). For steps 3.. it prints,
per phase and role, the cores used (CPU seconds / wall seconds) and the threads busy (those using
at least a quarter of a core over an interval, on average), and what the machine leaves idle.
Before it, the start-up's CPU seconds by role: from the command's start to the end of step 1's
generation (the engine's own start ends in it), where an end-to-end test spends most of its time.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from process_memory import TreeSampler, run_sampled  # noqa: E402  (bench scripts sit side by side, not in a package)
from results import Table, write  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
BUSY = 0.25  # a thread is busy over an interval when it used at least this share of a core


def thread_ticks(pid: int) -> dict[int, int]:
    """utime + stime of each thread of `pid`, in clock ticks."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = int(fields[11]) + int(fields[12])  # fields 14, 15 of proc(5): utime, stime
    return out


NAMES = {"EngineActor": "engine", "TrainWorker": "training ranks", "RolloutManager": "rollout manager",
         "python -B -c": "math-verify pool", "driver": "driver"}


def group(name: str) -> str:
    """Roles by their Ray actor class or executable (the reward's pool is a spawned `python -c`)."""
    name = name.replace("ray::", "")
    return NAMES.get(name, name)


class Sampler(TreeSampler):
    def __init__(self, root: int, every_s: float):
        super().__init__(root, every_s)
        self.samples: list[tuple[float, dict[int, dict[int, int]]]] = []  # (time, pid -> tid -> ticks)

    def read(self, procs) -> None:
        self.samples.append((time.time(), {p.pid: thread_ticks(p.pid) for p in procs}))

    def run(self) -> None:
        super().run()
        self.cpu_s = time.thread_time()


def phase_spans(path: str, first_step: int) -> tuple[list[float], list[tuple[float, str]]]:
    """Sorted phase starts and their (end, name), from phases.jsonl, steps >= first_step."""
    spans = sorted((r["end"] - r["s"], r["end"], r["phase"]) for r in map(json.loads, open(path))
                   if r["step"] >= first_step)
    return [s for s, _, _ in spans], [(e, name) for _, e, name in spans]


def charge(sampler: Sampler, starts, spans, first_t: float, last_t: float):
    """phase -> group -> [cpu seconds, busy-thread seconds], and phase -> wall seconds."""
    cpu = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0.0]))
    wall = collections.defaultdict(float)
    for (t0, before), (t1, after) in zip(sampler.samples, sampler.samples[1:]):
        mid, dt = (t0 + t1) / 2, t1 - t0
        if not first_t <= mid <= last_t:
            continue
        i = bisect.bisect_right(starts, mid) - 1
        phase = spans[i][1] if i >= 0 and mid <= spans[i][0] else "between phases"
        wall[phase] += dt
        for pid, ticks in after.items():
            g = group(sampler.names.get(pid, "?"))
            for tid, n in ticks.items():
                used = (n - before.get(pid, {}).get(tid, n)) / TICK
                cpu[phase][g][0] += used
                cpu[phase][g][1] += dt if used >= BUSY * dt else 0.0
    return cpu, wall


def print_start_up(sampler: Sampler, ready: float, cores: int) -> None:
    """CPU seconds by role from the first reading to `ready`, largest first, and the idle share."""
    t0 = sampler.samples[0][0]
    cpu, wall = charge(sampler, [t0], [(ready, "start-up")], t0, ready)
    by = sorted(cpu["start-up"].items(), key=lambda kv: -kv[1][0])
    used = sum(c for _, (c, _) in by)
    print(f"\nstart-up (command start -> step 1's batch generated): {wall['start-up']:.1f} s wall, {used:.1f} CPU s "
          f"on {cores} cores ({max(0.0, 1 - used / (cores * wall['start-up'])):.0%} idle)")
    print("| role | CPU s |\n|---|---|")
    for g, (c, _) in by:
        if c >= 0.05:
            print(f"| {g} | {c:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--config", default="quickstart")
    p.add_argument("--every", type=float, default=0.1)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        sampler = run_sampled(args.config, args.steps, args.overrides, out, lambda pid: Sampler(pid, args.every))
        _, every = phase_spans(os.path.join(out, "phases.jsonl"), first_step=1)
        starts, spans = phase_spans(os.path.join(out, "phases.jsonl"), first_step=3)
    cores = len(os.sched_getaffinity(0))
    ready = next(end for end, name in every if name in ("gen", "trainer_wait"))  # step 1's batch
    print_start_up(sampler, ready, cores)
    cpu, wall = charge(sampler, starts, spans, starts[0], spans[-1][0])
    # roles that never use a tenth of a core in any phase share one column
    peak = collections.defaultdict(float)
    for phase, by in cpu.items():
        for g, (c, _) in by.items():
            peak[g] = max(peak[g], c / wall[phase])
    for phase, by in cpu.items():
        for g in [g for g in by if peak[g] < 0.1]:
            c, b = by.pop(g)
            by["others"][0] += c
            by["others"][1] += b
    groups = sorted({g for by in cpu.values() for g in by}, key=lambda g: (g == "others", g))
    total_wall = sum(wall.values())
    print(f"\n{args.config}: cores used by role in each phase, steps 3..{args.steps}, {cores} cores, "
          f"readings every {args.every} s; overrides: {' '.join(args.overrides) or 'none'}")
    print("each cell: cores used (threads busy); idle = the cores the machine has less all used")
    print("| phase | share of the wall | " + " | ".join(groups) + " | all | idle |\n|" + "---|" * (len(groups) + 4))
    table = []
    for phase in sorted(wall, key=lambda ph: -wall[ph]):
        w = wall[phase]
        used = sum(c for c, _ in cpu[phase].values()) / w
        cells = [f"{cpu[phase][g][0] / w:.2f} ({cpu[phase][g][1] / w:.1f})" for g in groups]
        print(f"| {phase} | {w / total_wall:.0%} | {' | '.join(cells)} | {used:.2f} | {max(0.0, cores - used):.2f} |")
        table.append([f"{args.config}, {' '.join(args.overrides) or 'as shipped'}", phase, f"{w / total_wall:.0%}", *cells,
                      round(used, 2), round(max(0.0, cores - used), 2)])
    span = sampler.samples[-1][0] - sampler.samples[0][0]
    print(f"(the sampler itself, not counted above: {sampler.cpu_s / span:.2f} cores)")
    write("core_use", title="Cores each process of the quickstart uses in each phase",
          measures="The CPU time of every thread of every process of a quickstart run, charged to the phase of the "
                   "step it fell in: the cores each role used in each phase, and what the machine left idle.",
          tables=[Table("phases", f"Cores used by phase, {args.steps} steps, steps 3-{args.steps} (in brackets: threads "
                        f"busy at a quarter of a core or more), readings every {args.every} s",
                        ["layout, mode", "phase", "share of the wall", *groups, "all roles", f"idle of {cores}"], table)])


if __name__ == "__main__":
    main()
