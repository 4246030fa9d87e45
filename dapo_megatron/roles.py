"""Calls into the roles (Ray actors): a dead role is one clear error naming it, never a hang, and
an error a role raised reaches the caller as itself, not wrapped in the role's traceback."""
from __future__ import annotations

from typing import Callable, Optional

import ray

# While a call waits, how often the process's watch (`set_watch`) looks for roles that died
# elsewhere: a role blocked on a dead peer outside Ray (the rollout manager on a lost node's data
# plane, over ZMQ) would otherwise keep the call waiting forever.
WATCH_S = 2.0
_watch: Optional[Callable[[], None]] = None


def set_watch(watch: Optional[Callable[[], None]]) -> None:
    """`watch()` raises RoleDied for a role found dead; the driver sets one per run (driver/recovery.py)."""
    global _watch
    _watch = watch


def wait(refs: list, num_returns: int) -> list:
    """ray.wait without a timeout, the watch asked every WATCH_S while it waits; the refs done."""
    while True:
        done, _ = ray.wait(refs, num_returns=num_returns, timeout=WATCH_S if _watch else None)
        if len(done) >= num_returns or _watch is None:
            return done
        _watch()


class RoleDied(RuntimeError):
    """A role's process is gone (killed, OOM, a crashed library): the run restarts from its last
    checkpoint (trainer.max_restarts) or stops with this message. `what`: "the <role> died:
    <cause>"; `spent`: the key whose restarts ran out, if any. Both are the exception's args, so
    it crosses Ray (pickled) whole."""

    def __init__(self, what: str, spent: str = ""):
        super().__init__(what, spent)
        self.what, self.spent = what, spent

    def __str__(self) -> str:
        spent = f" ({self.spent}: every restart spent)" if self.spent else ""
        return f"{self.what}; restart the run, it resumes from the last checkpoint (trainer.resume_mode=auto){spent}"


def died(role: str, exc: Exception | str, spent: str = "") -> RoleDied:
    return RoleDied(f"the {role} died: {str(exc).splitlines()[0].rstrip('.')}", spent)


def as_role(role: str, fn: Callable, *args):
    """Run `fn` (which calls `role`); a dead Ray actor becomes one RoleDied naming the role."""
    try:
        return fn(*args)
    except ray.exceptions.RayActorError as exc:
        raise died(role, exc) from None


def get(role: str, refs):
    """ray.get of a role's call(s). An exception the role raised (e.g. the manager's "the rollout
    engine died") is re-raised as the original, so the console's last line is the role's message."""
    def get_():
        if _watch is not None:
            pending = refs if isinstance(refs, list) else [refs]
            wait(pending, len(pending))
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayError):
                raise cause from None
            if isinstance(cause, ray.exceptions.RayActorError):  # the role lives; what it called does not
                raise died(f"actor the {role} called", cause) from None
            raise
    return as_role(role, get_)
