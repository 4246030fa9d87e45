"""The engines' health, as the rollout manager sees it while it collects (rollout.max_engine_restarts,
rollout.engine_timeout_s).

A collection reports an engine whose process died, or that finished nothing for engine_timeout_s
while it had requests (killed first, so it cannot come back half-way); its in-flight prompts are
generated again elsewhere. The driver, which owns the placement and the training ranks (the
weights a new engine needs), long-polls `wait_dead`, starts a replacement in the dead engine's
bundle, syncs the current weights into it alone (checksummed) and hands it over with `replace`.
A collection that has no live engine left waits for that. Thread-safe: the collection and the
driver's calls run on different threads of the manager.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import ray

from dapo_megatron.roles import died

# How long a collection waits for the driver to bring a replacement before it gives up: an
# engine's start-up (minutes for a 30B model) plus its weight sync, with room.
REPLACE_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Death:
    engine: int  # its index in the manager's list
    cause: str
    in_flight: int  # its prompts that go back to the collection
    at: float  # time.time() of the report


class EngineHealth:
    """engines: the manager's list of engine handles (replaced in place); max_restarts: deaths
    that get a replacement in a run; timeout_s: no finished group for that long with requests
    in flight is a dead engine (0: no limit)."""

    def __init__(self, engines: list, max_restarts: int, timeout_s: float = 0.0):
        self.engines, self.max_restarts, self.timeout_s = engines, max_restarts, timeout_s
        self.dead: dict[int, Death] = {}
        self.restarts = 0  # deaths reported (each one is replaced)
        self._unclaimed: list[Death] = []  # reported, not yet taken by the driver's `wait_dead`
        self._cv = threading.Condition()

    def alive(self, engine: int) -> bool:
        return engine not in self.dead

    def report(self, engine: int, error: BaseException | str, in_flight: int) -> None:
        """An engine is gone: raise the run's RoleDied when no restart is left, else queue it for
        the driver. Called at most once per engine until it is replaced."""
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        if getattr(error, "actor_init_failed", False):  # its replacement would fail to start alike
            raise died("rollout engine", error)
        if self.restarts >= self.max_restarts:
            raise died("rollout engine", cause,
                       f"rollout.max_engine_restarts={self.max_restarts}" if self.max_restarts else "")
        with self._cv:
            self.restarts += 1
            death = Death(engine, cause, in_flight, time.time())
            self.dead[engine] = death
            self._unclaimed.append(death)
            self._cv.notify_all()

    def hung(self, engine: int, seconds: float, in_flight: int) -> None:
        """No progress for `seconds` with requests in flight: kill it (a hung process could answer
        later, into a collection that has moved on), then report it."""
        ray.kill(self.engines[engine], no_restart=True)
        self.report(engine, f"no finished group for {seconds:.0f} s with {in_flight} requests in flight "
                            f"(rollout.engine_timeout_s={self.timeout_s:g})", in_flight)

    def wait_dead(self, timeout: float) -> list[Death]:
        """The driver's long poll: deaths not yet handed to it (empty after `timeout` seconds)."""
        with self._cv:
            self._cv.wait_for(lambda: self._unclaimed, timeout=timeout)
            out, self._unclaimed = self._unclaimed, []
        return out

    def replace(self, engine: int, handle, count: bool = False) -> None:
        """`handle` in the dead engine's place; `count`: its death was not reported here (the
        driver saw it in a weight sync) but counts against max_restarts all the same."""
        with self._cv:
            self.restarts += count
            self.engines[engine] = handle
            self.dead.pop(engine, None)
            self._cv.notify_all()

    def wait_alive(self, any_of: bool = True) -> None:
        """Until one engine (any_of) or every engine is alive again."""
        def ready():
            return len(self.dead) < len(self.engines) if any_of else not self.dead
        with self._cv:
            if not self._cv.wait_for(ready, timeout=REPLACE_TIMEOUT_S):
                raise died("rollout engine", RuntimeError(
                    f"no replacement for engines {sorted(self.dead)} in {REPLACE_TIMEOUT_S:.0f} s"))
