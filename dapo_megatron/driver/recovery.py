"""A dead rollout engine replaced inside the step (rollout.max_engine_restarts): the driver's half.

The rollout manager reports the dead engine and generates its in-flight prompts again on the
others, or waits when none is left (rollout/health.py). The driver holds the placement and the
training ranks: it starts a replacement in the dead engine's bundle, syncs the current weights
into it alone (checksums compared), and hands it to the manager. Ray gives the death
(RayActorError) and frees the bundle; Ray's own actor restart (max_restarts) is not used: it
would bring the engine back with the checkpoint's weights, not the trainer's current ones.
`RoleWatch` finds the roles that died where no call of the driver would say so (a lost node's data
plane); trainer.max_restarts then restarts the run, whose placement waits for the node to return.
A training rank's process that died (not its node) restarts only the training ranks: `keep_roles`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import ray

from dapo_megatron import roles
from dapo_megatron.driver.metrics import write_event
from dapo_megatron.driver.weight_sync import sync_weights
from dapo_megatron.rollout.health import Death

POLL_S = 60.0  # the manager's long poll for deaths returns empty after this; the driver asks again
WATCH_GRACE_S = 10.0  # a death the awaited call has not raised by then is the watch's to report
ROLE_NAMES = {"TrainWorker": "training rank", "EngineActor": "rollout engine", "RolloutManager": "rollout manager",
              "TransferQueueController": "data plane's controller", "SimpleStorageUnit": "data plane's storage unit"}
UNEXPECTED = {"WORKER_DIED", "NODE_DIED"}  # not a ray.kill, an exit or a handle gone out of scope
KEPT = ("the rollout engines", "the rollout manager", "the data plane")  # what `keep_roles` keeps
UNTIL_S = 0.05  # wait_manager's `until`: how often it is asked
KEEP_CHECK_S = 20.0  # how long the kept roles (and Ray's record of the dead rank) may take to answer


def wait_manager(run, ref, get: bool = True, until=None):
    """roles.get of a manager call that collects (a batch), replacing engines that die meanwhile;
    get=False: only until it is done (its errors are the taker's). until(): asked every
    UNTIL_S while the call runs; True ends the wait (None returned, the call still running)."""
    restarts = run.cfg.rollout.max_engine_restarts
    if not restarts and until is None:
        return roles.get("rollout manager", ref) if get else roles.wait([ref], 1)
    while True:
        if restarts and run.deaths is None:
            run.deaths = run.ctx.manager.engine_deaths.remote(POLL_S)
        refs = [ref, run.deaths] if restarts else [ref]
        if until is None:
            roles.wait(refs, 1)
        elif not ray.wait(refs, num_returns=1, timeout=UNTIL_S)[0]:
            if until():
                return None
            continue
        if restarts and ray.wait([run.deaths], timeout=0)[0]:
            deaths, run.deaths = roles.get("rollout manager", run.deaths), None
            for death in deaths:
                replace(run, death)
            continue
        return roles.get("rollout manager", ref) if get else None


class RoleWatch:
    """The run's roles that died where no call of the driver sees it (`roles.set_watch`): a lost
    node takes the data plane's actors with it, and the rollout manager then waits on their ZMQ
    sockets forever. Ray's GCS knows every actor of this job that died, and how; engines are left
    to the manager when rollout.max_engine_restarts replaces them."""

    def __init__(self, skip_engines: bool):
        from ray._private import state  # the GCS actor table (ray.util.state needs the dashboard)
        self.actors = state.actors
        self.job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
        self.skip = {"EngineActor"} if skip_engines else set()
        self.since = time.time()  # deaths before (a start-up's) were the caller's to see

    def __call__(self) -> None:
        now, dead = time.time(), []
        for actor in self.actors(job_id=self.job, actor_state_name="DEAD").values():
            reason, cls = _reason(actor), actor["ActorClassName"].rsplit(".", 1)[-1]
            died_at = actor["EndTime"] / 1000
            if reason in UNEXPECTED and cls not in self.skip and self.since <= died_at < now - WATCH_GRACE_S:
                dead.append((f"{ROLE_NAMES.get(cls, cls)} (pid {actor['Pid']})", reason, actor))
        if not dead:
            return
        nodes = sorted({actor["Address"]["NodeID"][:8] for _, reason, actor in dead if reason == "NODE_DIED"})
        if nodes:
            raise roles.RoleDied(f"the Ray node {', '.join(nodes)} died, and with it the "
                                 f"{', '.join(name for name, _, _ in dead)}")
        name, _, actor = dead[0]
        message = actor["DeathCause"].actor_died_error_context.error_message
        raise roles.died(name, message.split(". ")[0])  # Ray's next sentences guess at causes


def replace(run, death: Death, reported: bool = True) -> None:
    """A new engine where the dead one was, with the trainer's weights; a line on the console,
    one in events.jsonl, its seconds in timing/engine_recovery. `reported`: the manager saw the
    death (and counted it against rollout.max_engine_restarts); else it counts it now."""
    cfg, ctx, i = run.cfg, run.ctx, death.engine
    run.engine_restarts += 1
    print(f"step {run.step + 1}: the rollout engine {i} died ({death.cause}); {death.in_flight} prompts in flight "
          f"generate again; replacing it ({run.engine_restarts} of rollout.max_engine_restarts="
          f"{cfg.rollout.max_engine_restarts})", flush=True)
    ray.kill(ctx.engines[i], no_restart=True)  # a hung process gives its bundle back
    t0 = time.perf_counter()
    with run.timed("engine_recovery", [f"engine {i}"]):
        new = ctx.placement.start_engine(i, run.engine_restarts)
        roles.get("rollout engine", new.num_in_flight.remote())  # started (the watch: its node may be gone)
        # Colocated: the actor's parameters are on the host while engines generate; the export
        # gathers them on the device, as the step's own sync does.
        params = ["params"] if "params" in run.share.offload else []
        if params:
            roles.as_role("actor", ctx.train.onload, params)
        try:
            with run.in_sync("replacement"):
                sync_weights(ctx.train, [new], cfg.rollout.sync, verify=True, version=run.syncs)
        finally:
            if params:
                roles.as_role("actor", ctx.train.offload, params)
        ctx.engines[i] = new  # the list the sync and the time share use
        roles.get("rollout manager", ctx.manager.replace_engine.remote(i, new, count=not reported))
    seconds = time.perf_counter() - t0
    write_event(cfg.trainer.default_local_dir, "engine_restart", what=f"rollout engine {i}: {death.cause}",
                step=run.step, seconds=round(seconds, 2), since_death_s=round(time.time() - death.at, 2),
                requeued=death.in_flight, restart=run.engine_restarts)
    print(f"step {run.step + 1}: rollout engine {i} replaced in {seconds:.1f} s", flush=True)


def replaces_in_sync(cfg) -> bool:
    """Whether the step's weight sync goes on past an engine that dies in it (the others synced)
    and the engine is replaced: object_store only (a broadcast group fails whole)."""
    return cfg.rollout.max_engine_restarts > 0 and cfg.rollout.sync.transport == "object_store"


def replace_lost_in_sync(run, lost: list[int]) -> None:
    """Engines that died in the step's weight sync, replaced once it is done, within
    rollout.max_engine_restarts (then the run stops, or restarts under trainer.max_restarts).
    With async partial rollouts the manager collects beside the sync: its next call to the dead
    engine reports the death (and requeues the groups it held), and the driver replaces it when
    it next waits for a batch (`wait_manager`), counted once."""
    if run.cfg.trainer.carries_in_flight:
        return
    limit = run.cfg.rollout.max_engine_restarts
    for i in lost:
        if run.engine_restarts >= limit:
            raise roles.died("rollout engine", f"engine {i} died in the weight sync", f"rollout.max_engine_restarts={limit}")
        replace(run, Death(i, "it died in the weight sync", 0, time.time()), reported=False)


def drop_pending(run) -> None:
    """Batches generated but never trained (the run ended, stopped or restarts): their rows go;
    their prompts are back in the stream of any checkpoint saved since (`Trainer.state_dict`). A
    deterministic run's partial rollouts held for a push that will not come go on to their end."""
    t = run.cfg.trainer
    if run.pending and t.deterministic and t.carries_in_flight:
        ray.wait(refs := [e.end_segments.remote() for e in run.ctx.engines], num_returns=len(refs), timeout=KEEP_CHECK_S)
    while run.pending:
        _, _, step = wait_manager(run, run.pending.popleft().last)  # the whole batch, once all its parts are
        if step is not None:
            roles.get("rollout manager", run.ctx.manager.release.remote(step.partition))


@dataclass
class Kept:
    """The roles a restart keeps (`ctx`, its training ranks dead or killed), and what the driver
    held of them: the manager's long poll for dead engines, the engines replaced so far (their
    names count on)."""
    ctx: object  # driver/setup.Context
    deaths: object
    engine_restarts: int


def keep_roles(run, died: roles.RoleDied) -> Optional[Kept]:
    """After a training rank died: whether the restart needs only new training ranks. An engine
    of a 30B run takes minutes to start (weights read, graphs captured) and does not depend on
    the ranks: it, the rollout manager and the data plane stay, and the restart's resume syncs
    the checkpoint's weights into them. Only when that is safe: the rank's process died (Ray
    says WORKER_DIED; a lost node takes other roles along), not in a weight sync the engines
    cannot be left in (`_sync_keeps`), a checkpoint exists (the engines hold later weights than
    the start), no async partial rollouts in flight, and the others answer. Else None: every
    role goes with this Ray, as before. Kept, the surviving ranks are killed (they wait in a
    collective with the dead one until trainer.dist_timeout_s)."""
    cfg, ctx = run.cfg, run.ctx
    rank = getattr(died, "rank", None)
    carried = cfg.trainer.carries_in_flight and not cfg.trainer.deterministic  # (segments end in drop_pending)
    if rank is None or not _sync_keeps(run) or run.checkpoint is None or carried:
        return None
    if death_reason(rank, KEEP_CHECK_S) != "WORKER_DIED":
        return None
    ctx.train.kill()
    roles.set_watch(RoleWatch(skip_engines=cfg.rollout.max_engine_restarts > 0))  # deaths from now on
    try:
        drop_pending(run)  # one_step_off / async: the batches asked ahead (the resume rewinds the stream)
        ray.get([ctx.manager.state_dict.remote(), *[e.num_in_flight.remote() for e in ctx.engines]],
                timeout=KEEP_CHECK_S)
    except (ray.exceptions.RayError, roles.RoleDied) as exc:
        print(f"the other roles cannot be kept ({str(exc).splitlines()[0]}); all of them start again", flush=True)
        return None
    return Kept(ctx, run.deaths, run.engine_restarts)


def _sync_keeps(run) -> bool:
    """No weight sync under way, or one whose engines stay fit to keep: object_store's engines get
    whole `load_weights` calls only, and `weight_sync.sync_weights` closes every engine's update however
    the push ended (mixed weights, which the resume's sync replaces, checksummed). Not broadcast
    (its receivers wait in a collective with the dead rank), nor a replacement's sync (the manager
    does not hold the new engine yet)."""
    return run.syncing is None or (run.syncing != "replacement" and run.cfg.rollout.sync.transport == "object_store")


def death_reason(actor, wait_s: float) -> Optional[str]:
    """Why Ray's GCS says `actor` died (WORKER_DIED: its process; NODE_DIED: its node), once it
    says so; None if it does not within `wait_s` (a lost node is declared after its health checks)."""
    from ray._private import state
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        info = state.actors(actor_id=actor._actor_id.hex())
        if info and info["State"] == "DEAD":
            return _reason(info)
        time.sleep(0.2)
    return None


def _reason(info: dict) -> str:
    """The reason of a dead actor's GCS entry (`ray._private.state.actors`): WORKER_DIED, NODE_DIED, RAY_KILL, ..."""
    context = info["DeathCause"].actor_died_error_context
    return context.Reason.Name(context.reason)
