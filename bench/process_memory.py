"""Memory of the quickstart by process: the peak PSS of each process of the run, and of their sum,
in each process layout (trainer.layout), alternated in one run.

    python bench/process_memory.py [--steps 6] [--layouts lean full] [--repeats 1] [--config quickstart] [key=value ...]

Runs the quickstart (or `--config`: quickstart_async is one training rank and one engine;
dynamic sampling off, no validation or checkpoints, plus any overrides) once per layout per
repeat, and samples every process of its tree every 0.5 s: the driver, the Ray daemons it starts
(GCS, raylet, agents) and every Ray worker (engine, training ranks, rollout manager, reward
worker, and in the full layout TransferQueue's controller and storage). PSS counts a page shared
by k processes as 1/k in each, so the sum is what the run costs the machine (RSS would count
torch's libraries once per process). CPU-s: every process's user + system time, summed.
"""
from __future__ import annotations

import argparse
import collections
import os
import tempfile
import threading
import time
from typing import Callable

import psutil
from common import NO_EVAL, run_main
from results import Table, write


def pss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def role(proc: psutil.Process) -> str:
    """A name for the process: the Ray actor's class (its title while it runs a method), the
    daemon's executable, or the driver."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return "?"
    title = " ".join(cmd)
    if title.startswith("ray::"):
        return title.split()[0].split(".")[0]  # ray::TrainWorker.step_update -> ray::TrainWorker
    if "default_worker.py" in title:  # before the daemons: its arguments name the raylet
        return "ray worker, no actor yet"
    for daemon in ("gcs_server", "raylet", "dashboard_agent", "runtime_env", "log_monitor", "monitor.py",
                   "dashboard.py"):
        if daemon in title:
            return daemon
    if "dapo_megatron.main" in title:
        return "driver"
    return " ".join(os.path.basename(c) for c in cmd[:3])[:60] if cmd else "?"


class TreeSampler(threading.Thread):
    """Every `every_s` s, `read(procs)` on the processes of the tree under `root`; `names`: pid ->
    the most specific role seen (not ray::IDLE)."""

    def __init__(self, root: int, every_s: float):
        super().__init__(daemon=True)
        self.root, self.every_s, self.stop = root, every_s, threading.Event()
        self.names: dict[int, str] = {}

    def read(self, procs: list[psutil.Process]) -> None:
        raise NotImplementedError

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                procs = [psutil.Process(self.root)] + psutil.Process(self.root).children(recursive=True)
            except psutil.Error:
                return
            self.read(procs)
            for p in procs:
                name = role(p)
                if name not in ("ray::IDLE", "?") or p.pid not in self.names:
                    self.names[p.pid] = name


class Sampler(TreeSampler):
    def __init__(self, root: int, every_s: float = 0.5):
        super().__init__(root, every_s)
        self.peak = collections.defaultdict(float)  # pid -> peak PSS (MB)
        self.cpu: dict[int, float] = {}  # pid -> user + system seconds, last read
        self.peak_sum = 0.0
        self.most = 0  # processes alive at once, at most

    def read(self, procs: list[psutil.Process]) -> None:
        self.most = max(self.most, len(procs))
        total = 0.0
        for p in procs:
            mb = pss_mb(p.pid)
            total += mb
            self.peak[p.pid] = max(self.peak[p.pid], mb)
            try:
                t = p.cpu_times()
                self.cpu[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        self.peak_sum = max(self.peak_sum, total)


def run_sampled(config: str, steps: int, overrides: list[str], out: str, sampler: Callable[[int], TreeSampler]
                ) -> TreeSampler:
    """The quickstart as `config` (dynamic sampling off, no validation or checkpoints, plus
    `overrides`) into `out`, with `sampler(its pid)` reading its process tree meanwhile."""
    readers = []

    def start(proc) -> None:
        readers.append(sampler(proc.pid))
        readers[0].start()
    try:
        run_main(config, ["algorithm.filter_groups.enable=false", f"trainer.total_training_steps={steps}", *NO_EVAL,
                          *overrides], out_dir=out, timeout=1800, on_start=start)
    finally:
        for reader in readers:
            reader.stop.set()
            reader.join()
    return readers[0]


def measure(config: str, steps: int, layout: str, overrides: list[str]) -> dict:
    """One run in `layout`: peak PSS by role (MB, summed over its processes), process counts, the
    peak of the sum, CPU-s of all processes, wall seconds."""
    t0 = time.time()
    with tempfile.TemporaryDirectory() as out:
        sampler = run_sampled(config, steps, [f"trainer.layout={layout}", *overrides], out, Sampler)
    by_role = collections.defaultdict(list)
    for pid, mb in sampler.peak.items():
        by_role[sampler.names[pid]].append(mb)
    return {"layout": layout, "wall_s": time.time() - t0, "peak_sum_mb": sampler.peak_sum,
            "cpu_s": sum(sampler.cpu.values()), "processes": sampler.most,
            "roles": {name: [len(mbs), sum(mbs)] for name, mbs in by_role.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--config", default="quickstart")
    p.add_argument("--layouts", nargs="+", default=["lean", "full"], choices=["lean", "full"])
    p.add_argument("--repeats", type=int, default=1, help="runs per layout, alternated")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    runs = [measure(args.config, args.steps, layout, args.overrides)
            for _ in range(args.repeats) for layout in args.layouts]
    # per layout, the run with the median peak sum (its roles' figures come from that run)
    chosen = {}
    for layout in args.layouts:
        mine = sorted((r for r in runs if r["layout"] == layout), key=lambda r: r["peak_sum_mb"])
        chosen[layout] = mine[len(mine) // 2]
    roles = sorted({name for r in chosen.values() for name, (_, mb) in r["roles"].items() if mb >= 1},
                   key=lambda n: -max(r["roles"].get(n, [0, 0])[1] for r in chosen.values()))
    rows = [[name] + [f"{round(r['roles'][name][1])}" + (f" ({r['roles'][name][0]})" if r["roles"][name][0] > 1 else "")
                      if name in r["roles"] else "-" for r in chosen.values()] for name in roles]
    first = chosen[args.layouts[0]]
    layout_rows = [[layout, r["processes"], round(r["peak_sum_mb"] / 1024, 2),
                    round(r["peak_sum_mb"] / first["peak_sum_mb"], 2), round(r["cpu_s"]), round(r["wall_s"])]
                   for layout, r in chosen.items()]
    with_what = f"{args.config}, {args.steps} steps" + (f", {' '.join(args.overrides)}" if args.overrides else "")
    tables = [Table("processes", f"{with_what}: peak PSS by process, MB (count when more than one)",
                    ["process", *(f"{layout} layout" for layout in chosen)], rows),
              Table("layouts", f"{with_what}: the run's processes by layout (trainer.layout); the median of "
                    f"{args.repeats} alternated run(s) each",
                    ["layout", "processes at once, at most", "peak PSS of the sum, GB", f"vs {args.layouts[0]}",
                     "CPU-s, all processes", "wall s"], layout_rows)]
    for t in tables:
        print(f"\n{t.title}\n| " + " | ".join(t.columns) + " |\n|" + "---|" * len(t.columns))
        for row in t.rows:
            print("| " + " | ".join(map(str, row)) + " |")
    saved = {layout: round(r["peak_sum_mb"] - first["peak_sum_mb"]) for layout, r in chosen.items()}
    write("process_memory", title="Memory of the quickstart by process",
          measures="The quickstart's peak PSS by process (the driver, Ray's daemons and every role) and of their sum, "
                   "sampled every 0.5 s, in each process layout (trainer.layout) alternated in one run; CPU-s: every "
                   "process's user + system time: what the run costs the machine.",
          tables=tables, extra={"runs": runs},
          summary=f"{with_what}: " + ", ".join(f"{layout} {r['peak_sum_mb'] / 1024:.2f} GB peak PSS in "
                                               f"{r['processes']} processes" for layout, r in chosen.items())
                  + "".join(f"; {layout} {mb:+d} MB against {args.layouts[0]}" for layout, mb in saved.items()
                            if layout != args.layouts[0]))


if __name__ == "__main__":
    main()
