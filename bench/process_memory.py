"""Memory of the quickstart by process: the peak PSS of each process of the run, and of their sum.

    python bench/process_memory.py [--steps 8] [--config quickstart] [key=value ...]

Runs the quickstart (or `--config`: quickstart_async is one training rank and one engine;
dynamic sampling off, no validation or checkpoints, plus any overrides)
and samples every process of its tree every 0.5 s: the driver, the Ray daemons it starts (GCS,
raylet, agents) and every Ray worker (engine, training ranks, rollout manager, reward worker,
TransferQueue's controller and storage). PSS counts a page shared by k processes as 1/k in each,
so the sum is what the run costs the machine (RSS would count torch's libraries once per process).
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
    for daemon in ("gcs_server", "raylet", "dashboard_agent", "runtime_env", "log_monitor", "monitor.py",
                   "dashboard.py"):
        if daemon in title:
            return daemon
    if "default_worker.py" in title:
        return "ray worker, no actor yet"
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
        self.peak_sum = 0.0

    def read(self, procs: list[psutil.Process]) -> None:
        total = 0.0
        for p in procs:
            mb = pss_mb(p.pid)
            total += mb
            self.peak[p.pid] = max(self.peak[p.pid], mb)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--config", default="quickstart")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as out:
        sampler = run_sampled(args.config, args.steps, args.overrides, out, Sampler)
    by_role = collections.defaultdict(list)
    for pid, mb in sampler.peak.items():
        by_role[sampler.names[pid]].append(mb)
    print(f"\n{args.config} processes, peak PSS (MB), {args.steps} steps in {time.time() - t0:.0f} s; "
          f"overrides: {' '.join(args.overrides) or 'none'}")
    print("| process | count | peak PSS MB (sum over its processes) |\n|---|---|---|")
    for name, mbs in sorted(by_role.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {name} | {len(mbs)} | {sum(mbs):.0f} |")
    print(f"| **all, peak of the sum** | {len(sampler.peak)} | **{sampler.peak_sum:.0f}** |")
    names = collections.Counter(sampler.names[pid] for pid in sampler.peak)
    ranks, engines = names["ray::TrainWorker"], names["ray::EngineActor"]
    write("process_memory", title="Memory of the quickstart by process",
          measures="The quickstart's peak PSS by process (the driver, Ray's daemons and every role) and of their sum, "
                   "sampled every 0.5 s: what the run costs the machine.",
          tables=[Table("processes", f"{args.config}, {args.steps} steps: peak PSS by process "
                        f"({sampler.peak_sum / 1024:.2f} GB in all, peak of the sum); overrides: "
                        f"{' '.join(args.overrides) or 'none'}", ["process", "PSS MB"],
                        [[f"{name} ({len(mbs)})" if len(mbs) > 1 else name, round(sum(mbs))]
                         for name, mbs in sorted(by_role.items(), key=lambda kv: -sum(kv[1]))]),
                  Table("layouts", "Peak PSS of the sum by layout", ["config", "training ranks", "engines", "peak PSS GB"],
                        [[args.config, ranks, engines, round(sampler.peak_sum / 1024, 2)]])])


if __name__ == "__main__":
    main()
