"""Our commands as a user runs them, in processes of their own: `python <args>`, output captured
(the journeys in tests/e2e: train -> export -> evaluate -> serve)."""
from __future__ import annotations

import os
import subprocess
import sys


def start(*args) -> subprocess.Popen:
    """`python <args>` started (a Ray of its own where it starts one: RAY_ADDRESS cleared)."""
    return subprocess.Popen([sys.executable, *map(str, args)], env={**os.environ, "RAY_ADDRESS": ""},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> subprocess.CompletedProcess:
    """Wait for a started command, which must exit 0 (else its stderr's end is the failure)."""
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, stderr[-3000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run(*args, timeout: float = 600) -> subprocess.CompletedProcess:
    return finish(start(*args), timeout)


def joining(ray) -> dict:
    """The environment in which a run in a process of its own joins the session's Ray (tests/
    conftest.py's `local_ray`) as a driver joins its cluster (RAY_ADDRESS; the token Ray's local
    start saved, ~/.ray/auth_token), instead of starting a Ray of its own beside it, ~4 s of the
    two cores a run. Its actors end with its driver, one killed -9 too."""
    return {"RAY_ADDRESS": ray.get_runtime_context().gcs_address, "RAY_AUTH_MODE": "token"}
