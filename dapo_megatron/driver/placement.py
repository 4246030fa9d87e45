"""Ray start-up and placement: which devices the training ranks and the engines run on.

colocated: one placement-group bundle per device; training rank i and an engine share bundle i
           (half of its device each), the engines sleeping while training runs.
split:     the first devices train, the last `rollout.num_devices` generate.
An engine takes the bundle of its first device; vLLM starts its own TP workers on that node.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dapo_megatron import dataplane
from dapo_megatron.config import DapoConfig, num_engines, role_devices
from dapo_megatron.device import get_device
from dapo_megatron.driver.workers import TrainGroup, TrainWorker
from dapo_megatron.logs import log_file
from dapo_megatron.models import ModelSpec

SHARE = 0.5  # fraction of a colocated device each role asks Ray for
ENGINE_NAME = "dapo-engine"  # engines are named actors: `ray.get_actor("dapo-engine-0")` finds one


@dataclass
class Placement:
    train: TrainGroup
    engines: list
    pg: object
    start_engine: Callable[[int, int], object]  # (engine index, restart) -> a new engine in its bundle


def init_ray(cfg: DapoConfig) -> None:
    """Join the cluster in RAY_ADDRESS (e.g. under `ray job submit`), else start a local one."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # The data plane's controller and storage units ask a CPU each and mostly wait on ZMQ:
        # advertise them on top of the cores, or on a small machine they never get scheduled.
        cpus = max(os.cpu_count() or 1, cfg.trainer.n_gpus_per_node) + dataplane.ray_cpus(cfg.data_plane)
        os.environ.update(dataplane.process_env())  # local Ray's workers inherit the driver's environment
        # WARNING: Ray's own start-up INFO lines are not for the console.
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)


def _options(device, pg, bundle: int, share: float) -> dict:
    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
    return dict(device.ray_options(share), scheduling_strategy=strategy)


def place(cfg: DapoConfig, model_path: str, spec: ModelSpec, max_model_len: int, *,
          tokenizer_path: str = "", data_plane: dataplane.Handle | None = None) -> Placement:
    """Create the placement group, the training ranks and the engines (not yet set up); both
    reach the data plane through `data_plane`."""
    from dapo_megatron.rollout.actor import engine_actor
    from dapo_megatron.rollout.engine_spec import EngineSpec
    device = get_device(cfg.trainer.device)
    devices = role_devices(cfg)
    colocated = cfg.trainer.placement == "colocated"
    total = devices["actor"] if colocated else devices["actor"] + devices["rollout"]
    pg = placement_group([{device.ray_resource: 1}] * total, strategy="PACK")
    ray.get(pg.ready(), timeout=300)
    share = SHARE if colocated else 1.0
    world = devices["actor"]
    run_dir = cfg.trainer.default_local_dir
    workers = [ray.remote(TrainWorker).options(**_options(device, pg, i, share)).remote(
        cfg, model_path, spec, i, world, log_file(run_dir, f"train-rank{i}"), data_plane) for i in range(world)]
    first = 0 if colocated else devices["actor"]
    tp = cfg.rollout.parallel.tp
    engine_spec = EngineSpec.from_model(model_path, cfg.rollout, model=spec, dtype=cfg.model.dtype,
                                        max_model_len=max_model_len, tokenizer_path=tokenizer_path,
                                        return_routes=cfg.actor.router_replay == "rollout")

    def start_engine(j: int, restart: int = 0):
        """Engine j in its bundle; a replacement (restart > 0) has a name of its own (its rows'
        keys start with it) and appends to the dead one's log."""
        name = f"{ENGINE_NAME}-{j}" + (f"-restart{restart}" if restart else "")
        return engine_actor(engine_spec, device=device.kind, name=name, log_path=log_file(run_dir, f"engine-{j}"),
                            data_plane=data_plane, **_options(device, pg, first + j * tp, share))
    engines = [start_engine(j) for j in range(num_engines(cfg))]
    return Placement(TrainGroup(workers), engines, pg, start_engine)
