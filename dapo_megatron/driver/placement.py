"""Ray start-up and placement: which devices the training ranks and the engines run on.

colocated: one placement-group bundle per device; training rank i and an engine share bundle i
           (half of its device each), the engines sleeping while training runs.
split:     the first devices train, the last `rollout.num_devices` generate.
An engine takes the bundle of its first device; vLLM starts its own TP workers on that node.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from dapo_megatron import dataplane, hooks
from dapo_megatron.config import ConfigError, DapoConfig, num_engines, role_devices
from dapo_megatron.device import get_device
from dapo_megatron.driver.workers import TrainGroup
from dapo_megatron.logs import log_file
from dapo_megatron.models import ModelSpec
from dapo_megatron.rollout.actor import engine_actor
from dapo_megatron.rollout.engine_spec import EngineSpec
from dapo_megatron.train.worker import TrainWorker

SHARE = 0.5  # fraction of a colocated device each role asks Ray for
# While the devices are missing (a lost node not back yet, a cluster still growing): the first
# line after this many seconds, then one a minute.
WAIT_LINE_S = (5.0, 60.0)
ENGINE_NAME = "dapo-engine"  # engines are named actors: `ray.get_actor("dapo-engine-0")` finds one


@dataclass
class Placement:
    train: TrainGroup
    engines: list
    pg: object
    start_engine: Callable[[int, int], object]  # (engine index, restart) -> a new engine in its bundle
    start_train: Callable[[], TrainGroup]  # new training ranks in the ranks' bundles (not set up)
    engine_names: list[str]  # every engine started, replacements too: `release` waits for them

    def release(self, timeout_s: float = 30.0) -> None:
        """Kill the engines, remove the placement group (the ranks with it) and wait until Ray has
        released the engines' names: a later run in this process (a notebook, a test session, on
        the Ray still up) names its engines the same. Removing the group alone left a named actor,
        and its name, registered while this driver held its handle (Ray 2.60): the next run
        failed with ActorAlreadyExistsError."""
        for engine in self.engines:
            ray.kill(engine, no_restart=True)
        ray.util.remove_placement_group(self.pg)
        deadline = time.monotonic() + timeout_s
        for name in self.engine_names:
            while time.monotonic() < deadline:
                try:
                    ray.get_actor(name)
                except ValueError:  # no actor of that name (any more)
                    break
                time.sleep(0.05)


def cluster_address() -> str | None:
    """The Ray cluster a run joins: RAY_ADDRESS (as `ray job submit` sets it), else the cluster
    `ray start` left running on this machine (Ray's own record of it, <RAY_TMPDIR or /tmp>/ray/
    ray_current_cluster, whose GCS must still run here); None: a Ray of the run's own
    (RAY_ADDRESS=local asks for one). A driver started by hand on a head node, as verl's and
    slime's guides do, joined nothing before and failed in ray.init."""
    address = os.environ.get("RAY_ADDRESS", "")
    if address == "local":
        return None
    if address:
        return address
    from ray._private.services import find_gcs_addresses
    from ray._private.utils import read_ray_address
    started = read_ray_address()
    return started if started and started in find_gcs_addresses() else None


def init_ray(cfg: DapoConfig) -> None:
    """Join the cluster (`cluster_address`), else start a local one."""
    if ray.is_initialized():
        return
    get_device(cfg.trainer.device).apply_host_env()  # the driver, and a local Ray's processes
    address = cluster_address()
    # a test's hooks for the roles' processes (dapo_megatron/hooks.py); none in a user's run
    runtime_env = {"worker_process_setup_hook": hooks.worker_setup} if hooks.worker_setup else None
    if address:
        if not os.environ.get("RAY_ADDRESS"):
            print(f"ray: joining the cluster at {address} that `ray start` runs on this machine "
                  f"(RAY_ADDRESS=local: a Ray of this run's own)", flush=True)
        ray.init(address=address, log_to_driver=True, runtime_env=runtime_env)
    else:
        # The data plane's controller and storage units (full layout) ask a CPU each and mostly wait
        # on ZMQ: advertise them on top of the cores, or on a small machine they never get scheduled.
        cpus = (max(os.cpu_count() or 1, cfg.trainer.n_gpus_per_node)
                + dataplane.ray_cpus(cfg.data_plane, here=cfg.trainer.lean))
        os.environ.update(dataplane.process_env())  # local Ray's workers inherit the driver's environment
        # WARNING: Ray's own start-up INFO lines are not for the console.
        # No task events: Ray's GCS kept up to 100k of them (~80 kB of memory a step here) for a
        # dashboard a local Ray does not start. A cluster's own: RAY_task_events_report_interval_ms=0.
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING,
                 _system_config={"task_events_report_interval_ms": 0}, runtime_env=runtime_env)


def wait_for_devices(pg, resource: str, count: int, timeout_s: float) -> None:
    """The placement group's bundles, waited for with a line now and then saying what is missing:
    after a node is lost (a run restarting under trainer.max_restarts) its devices come back when
    the node rejoins or another takes its place. Up to trainer.placement_timeout_s (0: no limit)."""
    ready, start = pg.ready(), time.monotonic()
    line_at = WAIT_LINE_S[0]
    while True:
        waited = time.monotonic() - start
        left = timeout_s - waited if timeout_s else float("inf")
        done, _ = ray.wait([ready], timeout=max(0.0, min(line_at - waited, left)))
        if done:
            ray.get(ready)
            return
        waited = time.monotonic() - start
        if timeout_s and waited >= timeout_s:
            ray.util.remove_placement_group(pg)
            raise ConfigError("trainer.placement_timeout_s", f"the cluster did not offer {count} x {resource} in "
                              f"trainer.placement_timeout_s={timeout_s:g} s ({_cluster_now(resource)}); bring its "
                              f"nodes back, or ask fewer devices (trainer.nnodes, trainer.n_gpus_per_node)")
        if waited >= line_at:
            print(f"placement: waiting {waited:.0f} s for {count} x {resource} ({_cluster_now(resource)}); a lost "
                  f"node's devices count again once it rejoins (trainer.placement_timeout_s={timeout_s:g})", flush=True)
            line_at = waited + WAIT_LINE_S[1]


def _cluster_now(resource: str) -> str:
    alive = sum(1 for node in ray.nodes() if node["Alive"])
    free, total = ray.available_resources().get(resource, 0), ray.cluster_resources().get(resource, 0)
    return f"{free:g} free of {total:g} on {alive} alive node{'s' if alive != 1 else ''}"


def beside_driver() -> dict:
    """Options of the rollout manager (no device): on the driver's node, the head under `ray job
    submit`, so the control plane does not die with a device node and sees that node's roles die
    (driver/recovery.RoleWatch). It asks no resource, so any node can take it; not `soft`: Ray then
    moved it off a head started with no CPU (measured, Ray 2.60)."""
    node = ray.get_runtime_context().get_node_id()
    return dict(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))


def _options(device, pg, bundle: int, share: float) -> dict:
    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
    return dict(device.ray_options(share), scheduling_strategy=strategy)


def place(cfg: DapoConfig, model_path: str, spec: ModelSpec, max_model_len: int, *,
          tokenizer_path: str = "", data_plane: dataplane.Handle | None = None) -> Placement:
    """Create the placement group, the training ranks and the engines (not yet set up); both
    reach the data plane through `data_plane`."""
    device = get_device(cfg.trainer.device)
    devices = role_devices(cfg)
    colocated = cfg.trainer.placement == "colocated"
    total = devices["actor"] if colocated else devices["actor"] + devices["rollout"]
    pg = placement_group([{device.ray_resource: 1}] * total, strategy="PACK")
    wait_for_devices(pg, device.ray_resource, total, cfg.trainer.placement_timeout_s)
    share = SHARE if colocated else 1.0
    world = devices["actor"]
    run_dir = cfg.trainer.default_local_dir
    # The host env in the ranks' runtime env too: on a cluster their workers do not inherit ours.
    deterministic = device.deterministic_env() if cfg.trainer.deterministic else {}
    ranks = dict(runtime_env={"env_vars": {**device.host_env(), **device.rank_env(), **deterministic}})

    def start_train() -> TrainGroup:
        return TrainGroup([ray.remote(TrainWorker).options(**_options(device, pg, i, share), **ranks).remote(
            cfg, model_path, spec, i, world, log_file(run_dir, f"train-rank{i}"), data_plane) for i in range(world)])
    first = 0 if colocated else devices["actor"]
    tp = cfg.rollout.parallel.tp
    engine_spec = EngineSpec.from_model(model_path, cfg.rollout, model=spec, dtype=cfg.model.dtype,
                                        max_model_len=max_model_len, tokenizer_path=tokenizer_path,
                                        return_routes=cfg.actor.router_replay == "rollout",
                                        deterministic=cfg.trainer.deterministic, engines=num_engines(cfg))

    names: list[str] = []

    def start_engine(j: int, restart: int = 0):
        """Engine j in its bundle; a replacement (restart > 0) has a name of its own (its rows'
        keys start with it) and appends to the dead one's log."""
        name = f"{ENGINE_NAME}-{j}" + (f"-restart{restart}" if restart else "")
        names.append(name)
        return engine_actor(engine_spec, device=device.kind, name=name, log_path=log_file(run_dir, f"engine-{j}"),
                            data_plane=data_plane, **_options(device, pg, first + j * tp, share))
    engines = [start_engine(j) for j in range(num_engines(cfg))]
    return Placement(start_train(), engines, pg, start_engine, start_train, names)
