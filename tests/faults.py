"""Faults for the end-to-end tests and bench/fault_recovery.py: a process killed -9 at a named
phase of a named step, as a crash or an OOM kill would, installed as `dapo_megatron.hooks` in the
process that acts. A fault is `<role>:<phase>:<step>`:

    driver:update:3   the driver itself, 0.3 s into step 3's update (or at its end when faster),
    driver:generate:2 or into its wait for step 2's batch (sync: the batch's generation)
    rank:update:2     training rank 0 once it runs step 2's update (its process title, polled every
    rank:sync:3       5 ms), or its weight push, or its save of step N's checkpoint (rank:save:4);
                      the driver kills it (one machine), once
    engine:sync:1     engine 0 as step 1's weight sync begins, killed by the driver, once
    engine:collect:2  engine 0 once it has requests of step 2's collection in flight, killed by the
                      rollout manager (its process gets the hook through Ray's worker setup hook)

In the test's own process (a run it starts in-process): `install(...)`, `uninstall()` after. A run
in a subprocess: `python tests/faults.py <the arguments of python -m dapo_megatron.main>` with
DAPO_TEST_FAULTS="driver:update:3,engine:sync:1" in its environment. Only stdlib and
dapo_megatron.hooks at the top: every Ray worker of such a run imports this module first.
"""
from __future__ import annotations

import contextlib
import os
import runpy
import signal
import threading
import time

from dapo_megatron import hooks

FAULTS_ENV = "DAPO_TEST_FAULTS"
ROLES_PHASES = {("driver", "generate"), ("driver", "update"), ("rank", "update"), ("rank", "sync"),
                ("rank", "save"), ("engine", "sync"), ("engine", "collect")}
_RANK_TITLES = {"update": "ray::TrainWorker.step_update", "sync": "ray::TrainWorker.push_weights",
                "save": "ray::TrainWorker.save"}
_DRIVER_DELAY_S = 0.3
HERE = os.path.dirname(os.path.abspath(__file__))


def _parse(fault: str) -> tuple[str, str, int]:
    role, phase, step = fault.split(":")
    if (role, phase) not in ROLES_PHASES:
        raise ValueError(f"no fault {fault!r}: <role>:<phase>:<step> with (role, phase) in {sorted(ROLES_PHASES)}")
    return role, phase, int(step)


def install(*faults: str) -> None:
    """The faults of the driver (this process); `engine:collect` ones are set up for the workers
    of the Ray the run starts (their environment is this process's)."""
    workers = []
    for fault in faults:
        role, phase, step = _parse(fault)
        if (role, phase) == ("engine", "collect"):
            workers.append(fault)
        elif role == "driver":
            hooks.install(f"driver.{phase}", _kill_driver(step))
        else:
            hooks.install(f"driver.{phase}", _kill_role(role, phase, step))
    if workers:
        os.environ[FAULTS_ENV] = ",".join(workers)
        path = os.environ.get("PYTHONPATH")
        _saved.setdefault("PYTHONPATH", path)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, path) if p)
        hooks.worker_setup = "faults.worker_setup"


_saved: dict = {}  # the environment install() changed, as it was


def uninstall() -> None:
    """This process as before `install`: no hooks, its environment back."""
    hooks.clear()
    os.environ.pop(FAULTS_ENV, None)
    for key, value in _saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _saved.clear()


def worker_setup() -> None:
    """Ray's worker_process_setup_hook: the rollout manager's faults (every worker installs them;
    only the manager reaches their point)."""
    for fault in filter(None, os.environ.get(FAULTS_ENV, "").split(",")):
        role, phase, step = _parse(fault)
        if (role, phase) == ("engine", "collect"):
            hooks.install("manager.collect", _kill_engine_during(step))


def _once(hook):
    fired = []

    def once(step, **where):
        if not fired:
            out = hook(step, **where)
            if out is not False:
                fired.append(True)
                return out
        return None
    return once


def _kill_driver(at: int):
    def hook(step, **_):
        if step != at:
            return False
        threading.Timer(_DRIVER_DELAY_S, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return _then_kill_self()
    return _once(hook)


@contextlib.contextmanager
def _then_kill_self():
    yield
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_role(role: str, phase: str, at: int):
    def hook(step, ctx, **_):
        if step != at:
            return False
        import psutil
        import ray
        process = psutil.Process(ray.get((ctx.train.workers[0] if role == "rank" else ctx.engines[0]).pid.remote()))
        if role == "engine":
            process.kill()
            process.wait(30)
            return None

        def kill():
            deadline = time.monotonic() + 120
            while not " ".join(process.cmdline()).startswith(_RANK_TITLES[phase]) and time.monotonic() < deadline:
                time.sleep(0.005)
            process.kill()
        threading.Thread(target=kill, daemon=True).start()
        return None
    return _once(hook)


def _sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _kill_engine_during(at: int):
    def hook(step, engines, **_):
        if step != at:
            return False
        import ray
        engine = engines[0]
        pid = ray.get(engine.pid.remote())

        def kill():
            while not ray.get(engine.num_in_flight.remote()):
                time.sleep(0.01)
            _sigkill(pid)
        threading.Thread(target=kill, daemon=True).start()
        return None
    return _once(hook)


if __name__ == "__main__":  # python tests/faults.py <python -m dapo_megatron.main's arguments>
    install(*filter(None, os.environ.pop(FAULTS_ENV, "").split(",")))
    runpy.run_module("dapo_megatron.main", run_name="__main__", alter_sys=True)
