"""What the tests marked `background` cost the tests they run beside: a selection of the
end-to-end phase with and without them, alternated.

    python dev/background_cost.py [--rounds 2] [-- pytest args ...]

Each round runs the selection (default: test_async.py, test_driver.py and test_shapes_sync.py,
~8-10 min here, serially as the test command's second phase does) twice, first alone, then with
`pytest -m background tests/unit` started beside it at idle CPU priority (`chrt --idle 0`, else
`nice -n 19`) as `launch/run_tests.sh` starts it. Prints each run's wall time, when the
background tests ended, and per round the difference. The machine's speed drifts between runs
(tens of seconds over half an hour here): the alternation and the rounds tell a drift from a cost.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

# bench/_trees.py (the baseline worktree) is shared with the benches that compare commits
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from _trees import HERE  # noqa: E402

IDLE = ["chrt", "--idle", "0"] if shutil.which("chrt") else ["nice", "-n", "19"]  # as launch/run_tests.sh
SELECTION = ["tests/e2e/test_async.py", "tests/e2e/test_driver.py", "tests/e2e/test_shapes_sync.py"]


def _run(selection: list[str], beside: bool, tmp: str) -> tuple[float, float | None]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "DAPO_TEST_BUNDLES": tempfile.mkdtemp(dir=tmp)}
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    start, ended = time.time(), []
    if beside:
        background = subprocess.Popen(
            [*IDLE, *pytest, "--basetemp", os.path.join(env["DAPO_TEST_BUNDLES"], "bg"),
             "-m", "background", "tests/unit"], cwd=HERE, env={**env, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        waiter = threading.Thread(target=lambda: ended.append((background.wait(), time.time() - start)))
        waiter.start()
    proc = subprocess.run([*pytest, *selection], cwd=HERE, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if beside:
        waiter.join()
        if ended[0][0] != 0:
            raise SystemExit("the background tests failed")
    if proc.returncode:
        raise SystemExit(f"the selection failed:\n{proc.stdout[-3000:]}")
    return wall, ended[0][1] if ended else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("selection", nargs="*", default=SELECTION, help="pytest arguments (default: three e2e files)")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            alone = _run(args.selection, False, tmp)
            beside = _run(args.selection, True, tmp)
            rows.append((r + 1, alone, beside))
            print(f"round {r + 1}: alone {alone[0]:.0f} s, beside the background tests {beside[0]:.0f} s",
                  file=sys.stderr, flush=True)
    print(f"\n`pytest {' '.join(args.selection)}`, wall seconds")
    print("| round | alone | with the background tests beside it | difference | background done by |")
    print("|---|---|---|---|---|")
    for r, alone, beside in rows:
        print(f"| {r} | {alone[0]:.0f} | {beside[0]:.0f} | {beside[0] - alone[0]:+.0f} | {beside[1]:.0f} |")


if __name__ == "__main__":
    main()
