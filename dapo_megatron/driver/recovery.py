"""A dead rollout engine replaced inside the step (rollout.max_engine_restarts): the driver's half.

The rollout manager reports the dead engine and generates its in-flight prompts again on the
others, or waits when none is left (rollout/health.py). The driver holds the placement and the
training ranks: it starts a replacement in the dead engine's bundle, syncs the current weights
into it alone (checksums compared), and hands it to the manager. Ray gives the death
(RayActorError) and frees the bundle; Ray's own actor restart (max_restarts) is not used: it
would bring the engine back with the checkpoint's weights, not the trainer's current ones.
"""
from __future__ import annotations

import time

import ray

from dapo_megatron import roles
from dapo_megatron.driver import setup
from dapo_megatron.driver.metrics import write_event
from dapo_megatron.rollout.health import Death

POLL_S = 60.0  # the manager's long poll for deaths returns empty after this; the driver asks again


def wait_manager(run, ref, get: bool = True):
    """roles.get of a manager call that collects (a batch), replacing engines that die meanwhile;
    get=False: only until it is done (its errors are the taker's)."""
    if not run.cfg.rollout.max_engine_restarts:
        return roles.get("rollout manager", ref) if get else ray.wait([ref], num_returns=1)
    while True:
        if run.deaths is None:
            run.deaths = run.ctx.manager.engine_deaths.remote(POLL_S)
        ray.wait([ref, run.deaths], num_returns=1)
        if ray.wait([run.deaths], timeout=0)[0]:
            deaths, run.deaths = roles.get("rollout manager", run.deaths), None
            for death in deaths:
                replace(run, death)
            continue
        return roles.get("rollout manager", ref) if get else None


def replace(run, death: Death) -> None:
    """A new engine where the dead one was, with the trainer's weights; a line on the console,
    one in events.jsonl, its seconds in timing/engine_recovery."""
    cfg, ctx, i = run.cfg, run.ctx, death.engine
    run.engine_restarts += 1
    print(f"step {run.step + 1}: the rollout engine {i} died ({death.cause}); {death.in_flight} prompts in flight "
          f"generate again; replacing it ({run.engine_restarts} of rollout.max_engine_restarts="
          f"{cfg.rollout.max_engine_restarts})", flush=True)
    ray.kill(ctx.engines[i], no_restart=True)  # a hung process gives its bundle back
    t0 = time.perf_counter()
    with run.timed("engine_recovery", [f"engine {i}"]):
        new = ctx.placement.start_engine(i, run.engine_restarts)
        roles.as_role("rollout engine", lambda: ray.get(new.num_in_flight.remote()))  # started
        # Colocated: the actor's parameters are on the host while engines generate; the export
        # gathers them on the device, as the step's own sync does.
        params = ["params"] if "params" in run.share.offload else []
        if params:
            roles.as_role("actor", ctx.train.onload, params)
        try:
            setup.sync_weights(ctx.train, [new], cfg.rollout.sync, verify=True)
        finally:
            if params:
                roles.as_role("actor", ctx.train.offload, params)
        ctx.engines[i] = new  # the list the sync and the time share use
        roles.get("rollout manager", ctx.manager.replace_engine.remote(i, new))
    seconds = time.perf_counter() - t0
    write_event(cfg.trainer.default_local_dir, "engine_restart", what=f"rollout engine {i}: {death.cause}",
                step=run.step, seconds=round(seconds, 2), since_death_s=round(time.time() - death.at, 2),
                requeued=death.in_flight, restart=run.engine_restarts)
    print(f"step {run.step + 1}: rollout engine {i} replaced in {seconds:.1f} s", flush=True)
