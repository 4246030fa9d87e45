"""Test hooks: a process killed -9 at a named phase of a named step, as a crash or an OOM kill
would (tests/e2e, bench). Read from the environment; nothing happens unless one is set.

DAPO_KILL_AT=update:<step>: the driver itself, 0.3 s into that step's update (or at its end when
the update is faster). DAPO_KILL_ROLE_AT=<rank|engine>:<update|sync>:<step>: training rank 0 once
it runs that step's update or weight push (its process title, polled every 5 ms: a test's scan of
every process missed the tiny update's second), or engine 0 as that phase begins (a threaded
actor's title names whichever call started last); once: the restarted role lives. The driver kills
it (one machine). A dead engine mid-generation: rollout/manager.py's DAPO_KILL_ENGINE_AT.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import ray

KILL_AT = "DAPO_KILL_AT"
KILL_ROLE_AT = "DAPO_KILL_ROLE_AT"
_RANK_TITLES = {"update": "ray::TrainWorker.step_update", "sync": "ray::TrainWorker.push_weights"}
_DRIVER_DELAY_S = 0.3


@contextlib.contextmanager
def injected(phase: str, step: int, ctx):
    """Around `phase` of `step`: the kills the environment asks for there (ctx: the run's roles)."""
    _kill_role(phase, step, ctx)
    driver = os.environ.get(KILL_AT) == f"{phase}:{step}"
    if driver:
        threading.Timer(_DRIVER_DELAY_S, os.kill, (os.getpid(), signal.SIGKILL)).start()
    yield
    if driver:
        os.kill(os.getpid(), signal.SIGKILL)


def _kill_role(phase: str, step: int, ctx) -> None:
    role, _, at = os.environ.get(KILL_ROLE_AT, "").partition(":")
    if at != f"{phase}:{step}":
        return
    import psutil
    os.environ.pop(KILL_ROLE_AT)
    process = psutil.Process(ray.get((ctx.train.workers[0] if role == "rank" else ctx.engines[0]).pid.remote()))
    if role == "engine":
        process.kill()
        process.wait(30)
        return

    def kill():
        deadline = time.monotonic() + 120
        while not " ".join(process.cmdline()).startswith(_RANK_TITLES[phase]) and time.monotonic() < deadline:
            time.sleep(0.005)
        process.kill()
    threading.Thread(target=kill, daemon=True).start()
