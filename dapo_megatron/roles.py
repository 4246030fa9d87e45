"""Calls into the roles (Ray actors): a dead role is one clear error naming it, never a hang, and
an error a role raised reaches the caller as itself, not wrapped in the role's traceback."""
from __future__ import annotations

import re
from typing import Callable, Optional

import ray

from dapo_megatron.config import engine_arg_keys

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


class StartFailed(RuntimeError):
    """A role raised while it started (its __init__: vLLM's checks of the engine's arguments, a
    file it could not read). Starting it again fails the same way, so no restart is made: the
    message is the library's own, with the config keys it names."""


# The Ray actor classes -> the role each is (a start-up error names the class, not the role).
ACTOR_ROLES = {"EngineActor": "rollout engine", "TrainWorker": "training rank", "RolloutManager": "rollout manager",
               "RewardActor": "reward worker"}


def died(role: str, exc: Exception | str, spent: str = "") -> RoleDied | StartFailed:
    """What a dead role is to its caller: StartFailed when its __init__ raised, else RoleDied."""
    if getattr(exc, "actor_init_failed", False):
        return start_failed(role, str(exc))
    if isinstance(exc, ray.exceptions.OutOfMemoryError):  # Ray's memory monitor killed it
        return RoleDied(f"the {role} was killed by Ray for lack of host memory: {str(exc).splitlines()[0]}", spent)
    return RoleDied(f"the {role} died: {str(exc).splitlines()[0].rstrip('.')}", spent)


def start_failed(role: str, error: str) -> StartFailed:
    """One line from a start-up traceback (Ray's text of the actor's creation task): the role
    (from the actor's class), the library's own message and the config keys it names."""
    error = re.sub(r"\x1b\[[0-9;]*m", "", error)
    actor = re.search(r"ray::(?:[\w.-]+:)?(\w+)\.__init__", error)
    role = ACTOR_ROLES.get(actor.group(1), role) if actor else role
    cause = root_cause(error)
    keys = engine_arg_keys(cause) if role == "rollout engine" else []
    return StartFailed(f"the {role} did not start: {cause}" + (f" (set by {', '.join(keys)})" if keys else ""))


def root_cause(traceback: str) -> str:
    """The library's message in a traceback: pydantic's "Value error, ..." (vLLM's argument
    checks), else the first line of the last exception raised."""
    value = re.search(r"Value error, (.*?)(?: \[type=|$)", traceback, re.M)
    if value:
        return value.group(1).rstrip(".")
    raised = re.findall(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$", traceback, re.M)
    if not raised:
        return traceback.strip().splitlines()[-1] if traceback.strip() else "no message"
    name, message = raised[-1]
    return (message if name in ("RuntimeError", "Exception") else f"{name}: {message}").rstrip(".")


def as_role(role: str, fn: Callable, *args):
    """Run `fn` (which calls `role`); a dead Ray actor becomes one RoleDied naming the role."""
    try:
        return fn(*args)
    except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as exc:
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
            if isinstance(cause, (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)):
                raise died(f"actor the {role} called", cause) from None  # the role lives; its callee not
            raise
    return as_role(role, get_)
