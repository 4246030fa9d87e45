"""Named points inside a run where a test installs code that acts there (fault injection: a role
killed -9 at a named phase of a named step, as a crash or an OOM kill would). Package code names
the point and passes what it knows there; nothing runs unless a hook was installed in that process
(tests/faults.py installs them; the package reads no test setting).

    driver.generate             (step, ctx)      around the driver's wait for a step's batch (or part)
    driver.update, driver.sync  (step, ctx)      around a step's update / weight push, in the driver
    driver.save  (step, ctx)                     around the save of step's checkpoint, in the driver
    manager.collect             (step, engines)  as the rollout manager starts a step's collection

A hook for a role's process gets there through Ray's worker_process_setup_hook: `worker_setup`
(a function's module path), set in the driver before its Ray starts, is what every worker of the
run calls first (driver/placement.init_ray passes it).
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional

POINTS = ("driver.generate", "driver.update", "driver.sync", "driver.save", "manager.collect")
_installed: dict[str, list[Callable[..., Optional[ContextManager]]]] = {}
worker_setup: Optional[str] = None


def install(point: str, hook: Callable[..., Optional[ContextManager]]) -> None:
    """`hook(**where)` runs at `point` in this process; what it returns (a context manager, or
    None) wraps the work done there."""
    if point not in POINTS:
        raise ValueError(f"no hook point {point!r}; the points are {', '.join(POINTS)}")
    _installed.setdefault(point, []).append(hook)


def clear() -> None:
    """Every hook of this process, and the workers' setup hook."""
    global worker_setup
    _installed.clear()
    worker_setup = None


@contextlib.contextmanager
def at(point: str, **where):
    """Around the work done at `point`: the hooks installed there, in their order."""
    with contextlib.ExitStack() as stack:
        for hook in _installed.get(point, ()):
            entered = hook(**where)
            if entered is not None:
                stack.enter_context(entered)
        yield
