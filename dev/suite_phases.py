"""The test command's wall time by phase, and how much of the two cores each phase keeps busy:
this checkout against an earlier commit, one after the other in one run.

    python dev/suite_phases.py [--baseline 37cb238] [--every 2] [--logs DIR]

Runs each tree's own `launch/run_tests.sh` (the README's test command, what CI runs) with this
checkout's venv, the tree first on PYTHONPATH: linked into the baseline's worktree, with the set-up
stamp its files ask for written into the venv for the run (and removed after), so that nothing is
installed. Reads /proc/stat every `--every` s and stamps each line the command prints. A phase ends
at the line pytest prints at its end (`N passed ... in S s`); the tests marked `background` (run at
idle priority beside the phases since 9769318) end when their pytest process does. Prints per run:
each phase's wall time and the share of the two cores busy in it, the background tests' end, the
total. A CPU-bound machine shows in the busy share; the end-to-end phase's idle third is what the
background tests take. `--logs`: each run's output (its per-phase slowest tests) saved there.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import psutil

# bench/_trees.py (the baseline worktree) is shared with the benches that compare commits
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from _trees import HERE, checkouts  # noqa: E402

SUMMARY = re.compile(r"^\d+ (passed|failed)\b.* in [\d.]+s")


def _cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all cores since boot."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def _stamp(tree: str) -> str:
    """The venv's set-up stamp `launch/setup_env.sh` looks for in `tree` (a CPU machine's)."""
    src = b"".join(open(os.path.join(tree, f), "rb").read()
                   for f in ("pyproject.toml", "launch/constraints-cpu.txt", "launch/setup_env.sh"))
    return ".dapo-setup-" + hashlib.sha256((src + b"cpu").rstrip(b"\n")).hexdigest()[:16]


def _run(tree: str, every: float, log: str = "") -> dict:
    venv = os.path.join(HERE, ".venv")
    if tree != HERE and not os.path.exists(os.path.join(tree, ".venv")):
        os.symlink(venv, os.path.join(tree, ".venv"))
    stamp = os.path.join(venv, _stamp(tree))
    made = not os.path.exists(stamp)
    if made:
        open(stamp, "w").close()
    samples, lines, stop = [], [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((time.time(), *_cpu()))
            stop.wait(every)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.time()
    try:
        # PYTHONPATH: every process of the run imports the tree's own package, also those that do
        # not start in it (a `ray job submit` job's driver otherwise imports the venv's editable
        # install: the code of the checkout that set the venv up, whatever the tree)
        path = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(["bash", "launch/run_tests.sh"], cwd=tree, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, "CI": "true", "PYTHONPATH": path})
        background_end = [None]

        def background_alive() -> bool:  # pytest ... -m background ..., a child of the command
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    cmd = child.cmdline()
                    if any(a == "-m" and b == "background" for a, b in zip(cmd, cmd[1:])):
                        return True
            return False

        def watch_background():
            seen = False
            while proc.poll() is None:
                alive = False
                with contextlib.suppress(psutil.Error):
                    alive = background_alive()
                if alive:
                    seen = True
                elif seen:
                    background_end[0] = time.time() - start
                    return
                time.sleep(1)
        watcher = threading.Thread(target=watch_background, daemon=True)
        watcher.start()
        for line in proc.stdout:
            lines.append((time.time() - start, line.rstrip("\n")))
        proc.wait()
        watcher.join(timeout=5)
    finally:
        stop.set()
        sampler.join()
        if made:
            os.remove(stamp)
    total = time.time() - start
    if log:
        with open(log, "w") as f:
            f.writelines(f"{t:8.1f} {text}\n" for t, text in lines)
    if proc.returncode:
        tail = "\n".join(text for _, text in lines[-40:])
        raise SystemExit(f"the test command failed in {tree} (rc {proc.returncode}):\n{tail}")
    ends = [t for t, text in lines if SUMMARY.match(text)]
    bounds = [0.0, ends[0], ends[1]]  # the unit phase's summary, then the distributed + e2e one's
    phases = {}
    for name, (a, b) in zip(("unit", "distributed + e2e"), zip(bounds, bounds[1:])):
        inside = [(busy_j, total_j) for t, busy_j, total_j in samples if start + a <= t <= start + b]
        busy = float("nan")
        if len(inside) > 1:
            busy = (inside[-1][0] - inside[0][0]) / max(inside[-1][1] - inside[0][1], 1)
        phases[name] = (b - a, busy)
    return {"phases": phases, "background": background_end[0], "total": total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="37cb238", help="a commit, or none")
    p.add_argument("--every", type=float, default=2.0, help="seconds between two readings of /proc/stat")
    p.add_argument("--logs", default="", help="save each run's output in this folder")
    args = p.parse_args()
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, checkouts(args.baseline, tmp) as trees:
        for name, tree in trees:
            print(f"running the test command in {name} ...", file=sys.stderr, flush=True)
            log = os.path.join(args.logs, f"{name.replace(' ', '-')}.log") if args.logs else ""
            rows.append((name, _run(tree, args.every, log)))
    print("\n`bash launch/run_tests.sh` (CI=true), seconds; busy: the share of the cores in use (/proc/stat)")
    print("| checkout | set-up + unit phase (busy) | distributed + e2e (busy) | background tests end at | total |")
    print("|---|---|---|---|---|")
    for name, m in rows:
        cells = [f"{s:.0f} ({busy:.0%})" for s, busy in m["phases"].values()]
        background = "-" if m["background"] is None else f"{m['background']:.0f}"
        print(f"| {name} | {' | '.join(cells)} | {background} | {m['total']:.0f} |")


if __name__ == "__main__":
    main()
