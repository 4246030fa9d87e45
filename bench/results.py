"""Bench results as data: every bench script ends by writing `bench/results/<name>.json`, and
docs/benchmarks.md (and each `<!-- bench:NAME/TABLE -->` block of the other pages) is generated
from those files by `bench/render.py`. A figure in the docs is then always the last run's, with
its command, date, commit and the machine's speed beside it, never a number typed into prose.

    from results import Table, write
    write("async_throughput", title=..., measures=..., tables=[Table("modes", "...", columns, rows)])
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
# the keys every results file has (render.py refuses a file without one, naming it)
REQUIRED = ("name", "title", "measures", "command", "date", "commit", "machine", "tables")


@dataclasses.dataclass
class Table:
    id: str
    title: str
    columns: list[str]
    rows: list[list]
    note: str = ""


def machine_speed(repeats: int = 5) -> dict:
    """A fixed CPU workload, timed where the bench ran, so that results from a slow hour read as
    such: one thread's best of `repeats` for a pure-Python loop and for a 512x512 fp32 matmul x 20
    (the two kinds of work our CPU runs spend their time in). Lower is faster."""
    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return round(min(times), 4)

    def python_loop():
        s = 0
        for i in range(2_000_000):
            s += i * i
        return s

    speed = {"python_loop_s": best(python_loop)}
    try:
        import torch
    except ImportError:
        return speed
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(512, 512)
        speed["matmul_s"] = best(lambda: [a @ a for _ in range(20)])
    finally:
        torch.set_num_threads(threads)
    return speed


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write(name: str, *, title: str, measures: str, tables: list[Table], summary: str = "",
          plots: list[str] = (), command: str | None = None, extra: dict | None = None,
          results_dir: str = RESULTS) -> str:
    """Write `results_dir/<name>.json` for this run and return its path. `command` defaults to
    this process's own command line; `extra` holds a bench's raw figures for later readers."""
    if command is None:
        command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    for t in tables:
        for i, row in enumerate(t.rows):
            if len(row) != len(t.columns):
                raise ValueError(f"{name}: table {t.id!r} row {i} has {len(row)} cells for {len(t.columns)} columns")
    doc = {
        "name": name, "title": title, "measures": measures, "command": command,
        "date": datetime.date.today().isoformat(), "commit": _commit(),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "speed": machine_speed()},
        "source": "measured",
        "tables": [dataclasses.asdict(t) for t in tables],
        "plots": list(plots), "summary": summary,
    }
    if extra:
        doc["extra"] = extra
    os.makedirs(results_dir, exist_ok=True)
    path = os.path.join(results_dir, f"{name}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)
    print(f"results: {os.path.relpath(path, ROOT)} (python bench/render.py updates the docs)")
    return path


if __name__ == "__main__":  # the reference alone: python bench/results.py
    print(json.dumps(machine_speed()))
