"""The package's hook points (dapo_megatron/hooks.py) and the tests' faults installed through them
(tests/faults.py): the package reads no test setting from the environment."""
from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest

from dapo_megatron import hooks
from tests import faults

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(faults.FAULTS_ENV, raising=False)
    monkeypatch.setenv("PYTHONPATH", "")
    yield
    hooks.clear()


def test_hooks_run_in_order_around_the_work_at_their_point():
    seen = []

    @contextlib.contextmanager
    def around(step, ctx):
        seen.append(("enter", step, ctx))
        yield
        seen.append(("exit", step))
    hooks.install("driver.update", around)
    hooks.install("driver.update", lambda step, ctx: seen.append(("plain", step)))
    with hooks.at("driver.update", step=3, ctx="roles"):
        seen.append("work")
    with hooks.at("driver.sync", step=3, ctx="roles"):  # nothing installed there
        seen.append("sync")
    assert seen == [("enter", 3, "roles"), ("plain", 3), "work", ("exit", 3), "sync"]
    with pytest.raises(ValueError, match=r"no hook point 'driver.updat'; the points are driver.generate, driver.update"):
        hooks.install("driver.updat", around)


def test_faults_go_where_they_act():
    """Driver faults are hooks of this process; the manager's reach the run's Ray workers through
    their setup hook (a module path on their PYTHONPATH), each acting once at its step."""
    faults.install("rank:update:2", "rank:save:3", "driver:generate:2", "engine:collect:4")
    assert {p: len(hooks._installed.get(p, [])) for p in hooks.POINTS} == \
        {"driver.generate": 1, "driver.update": 1, "driver.sync": 0, "driver.save": 1, "manager.collect": 0}
    assert hooks.worker_setup == "faults.worker_setup"
    import os
    assert os.environ[faults.FAULTS_ENV] == "engine:collect:4" and faults.HERE in os.environ["PYTHONPATH"]
    faults.worker_setup()  # as a worker of the run
    assert len(hooks._installed["manager.collect"]) == 1
    with pytest.raises(ValueError, match=r"no fault 'engine:update:1'"):
        faults.install("engine:update:1")
    faults.uninstall()  # the process as before: a later run in it starts no faults
    assert (os.environ["PYTHONPATH"], hooks.worker_setup, hooks._installed) == ("", None, {})
    assert faults.FAULTS_ENV not in os.environ


def test_a_fault_fires_once_at_its_step(monkeypatch):
    """engine:collect:2 kills engine 0 once it has requests of step 2 in flight, and only once:
    its replacement generating step 2 again lives."""
    import itertools
    import threading
    killed = threading.Semaphore(0)
    pids = []
    monkeypatch.setattr(faults, "_sigkill", lambda pid: (pids.append(pid), killed.release()))
    monkeypatch.setattr("ray.get", lambda ref: ref)
    in_flight = itertools.chain([0, 0], itertools.repeat(3))

    class Engine:
        class pid:
            remote = staticmethod(lambda: 4321)

        class num_in_flight:
            remote = staticmethod(lambda: next(in_flight))
    faults.worker_setup()  # nothing asked: nothing installed
    assert not hooks._installed
    hook = faults._kill_engine_during(2)
    assert hook(step=1, engines=[Engine]) is None
    hook(step=2, engines=[Engine])
    assert killed.acquire(timeout=10) and pids == [4321]
    hook(step=2, engines=[Engine])
    assert not killed.acquire(timeout=0.2) and pids == [4321]


def test_the_package_reads_no_fault_setting():
    """Fault injection is the tests' hooks, not environment variables read by package code."""
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in (ROOT / "dapo_megatron").rglob("*.py")
             for m in re.finditer(r"DAPO_(KILL|TEST)\w*", p.read_text())]
    assert found == []
