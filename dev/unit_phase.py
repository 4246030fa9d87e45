"""The test suite's unit phase as `launch/run_tests.sh` runs it, with when each test ran on which
xdist worker: this checkout against an earlier commit, alternated in one run.

    python dev/unit_phase.py [--baseline a84b4be] [--rounds 1] [--top 4]

Each run builds the tool task's bundle beside the phase into a fresh `$DAPO_TEST_BUNDLES` and runs
`pytest -n 2 -m "not background" tests/unit` with one OpenMP thread, as the test command does (the
tests marked `background` it runs beside the phases at idle priority: `dev/suite_phases.py`), from
this checkout and from the baseline commit checked out into a temporary git worktree (`--baseline
none`: this checkout only), with this venv. A pytest plugin (`_test_times.py`, beside this file) logs each
test's start and end on its worker. Prints, per run: the phase's wall time, when each worker
finished, the worker-seconds left idle before the phase ended, when the bundle's build ended, and
the `--top` longest tests with their worker and start -> end (seconds from the phase's start).
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import threading
import time

# bench/_trees.py (the baseline worktree) is shared with the benches that compare commits
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from _trees import checkouts  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(tree: str, tmp: str) -> dict:
    times = os.path.join(tmp, "times.txt")
    bundles = tempfile.mkdtemp(prefix="dapo-test-bundles-", dir=tmp)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "DAPO_TEST_BUNDLES": bundles, "TEST_TIMES": times,
           # the tree's package and tests first; this folder for the plugin
           "PYTHONPATH": os.pathsep.join(p for p in (tree, HERE, os.environ.get("PYTHONPATH")) if p)}
    start = time.time()
    builder = subprocess.Popen([sys.executable, "-c", "import sys; from tests.conftest import build_tool_bundle; "
                                "build_tool_bundle(sys.argv[1])", bundles], cwd=tree, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    built: list[float] = []  # when the build ended (its tests touch the bundle's lock file later)
    waiter = threading.Thread(target=lambda: builder.wait() == 0 and built.append(time.time() - start))
    waiter.start()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_test_times",
                           "-n", "2", "-m", "not background", "tests/unit"], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=3600)
    waiter.join()
    wall = time.time() - start
    if proc.returncode:
        raise SystemExit(f"the unit phase failed in {tree}:\n{proc.stdout[-3000:]}")
    spans, ends = {}, collections.defaultdict(float)
    for line in open(times):
        t, worker, what, nodeid = line.rstrip("\n").split(" ", 3)
        spans.setdefault(nodeid, [worker, None, None])[1 if what == "start" else 2] = float(t) - start
        if what == "end":
            ends[worker] = max(ends[worker], float(t) - start)
    return {"wall": wall, "ends": dict(sorted(ends.items())), "built": built[0] if built else None,
            "idle": sum(wall - e for e in ends.values()), "spans": spans}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="a84b4be", help="a commit, or none")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--top", type=int, default=4, help="longest tests shown per run")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, checkouts(args.baseline, tmp) as trees:
        for r in range(args.rounds):
            for name, tree in trees:
                rows.append((f"{name}, {r + 1}", _run(tree, tempfile.mkdtemp(dir=tmp))))
    print("\nunit phase (`pytest -n 2 -m 'not background' tests/unit`, the tool bundle built beside it), seconds from "
          "its start")
    print("| run | phase | workers done at | worker-s idle | bundle built at | longest tests (worker: start -> end) |")
    print("|---|---|---|---|---|---|")
    for name, m in rows:
        top = sorted(m["spans"].items(), key=lambda kv: -((kv[1][2] or 0) - (kv[1][1] or 0)))[:args.top]
        longest = "; ".join(f"{nodeid.split('::')[-1]} ({w}: {s:.0f} -> {e:.0f})" for nodeid, (w, s, e) in top)
        built = "-" if m["built"] is None else f"{m['built']:.0f}"
        print(f"| {name} | {m['wall']:.0f} | {' / '.join(f'{e:.0f}' for e in m['ends'].values())} | {m['idle']:.0f} "
              f"| {built} | {longest} |")


if __name__ == "__main__":
    main()
