"""pytest plugin of dev/unit_phase.py: each test's start and end, with its xdist worker, appended
to $TEST_TIMES as `<unix time> <worker> start|end <nodeid>` (one short write a line: the workers
share the file). Only xdist workers write: the controlling process hears of the same tests."""
from __future__ import annotations

import os
import time


def _log(what: str, nodeid: str) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        with open(os.environ["TEST_TIMES"], "a") as f:
            f.write(f"{time.time():.3f} {worker} {what} {nodeid.replace(chr(10), '|')}\n")


def pytest_runtest_logstart(nodeid, location):
    _log("start", nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _log("end", nodeid)
