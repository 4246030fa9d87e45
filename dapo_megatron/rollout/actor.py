"""The engine as a Ray actor: the same `Engine` class, placed by the driver.

The actor process owns the vLLM engine in-process, so buckets sent to `load_weights` arrive as
tensors from Ray's object store and go into the model without another copy. Ray calls run on
several threads (`max_concurrency`) so that a `poll` waiting for results does not block `submit`,
`abort` or a weight push; `Engine` serialises them onto its loop thread.

Given a data plane, the actor puts each finished group's rows there (keys
`<engine>/<request id>/<i>`, in the caller's partition; a prompt with images also gets one row
`<engine>/<request id>/images` of its pixels, shared by its n responses) and returns a
`StoredGroup`: the driver gets keys and lengths, never tokens or pixels.
"""
from __future__ import annotations

import os
from typing import Optional

from dapo_megatron import dataplane, heap
from dapo_megatron.batch import Prompt
from dapo_megatron.device import get_device
from dapo_megatron.logs import redirect_output
from dapo_megatron.rollout.engine import Engine
from dapo_megatron.rollout.engine_spec import EngineSpec
from dapo_megatron.rollout.types import RolloutGroup, Sampling, row_prefix

# Concurrent actor calls: poll + submit + abort + weight pushes, and with the broadcast sync
# transport one blocking `receive_weights` per sending trainer rank (EP ranks x PP stages).
MAX_CONCURRENCY = 64


class EngineActor(Engine):
    """`Engine` in its own process, its library output sent to `log_path` before vLLM starts."""

    @heap.start_up()  # vLLM's imports and the model, this process's to keep
    def __init__(self, *args, log_path: Optional[str] = None, data_plane=None, name: str = "", **kwargs):
        redirect_output(log_path)
        super().__init__(*args, **kwargs)
        self._store = GroupStore(data_plane, name)

    def pid(self) -> int:
        return os.getpid()

    def submit(self, request_id: str, prompt: Prompt, sampling: Sampling, index: int = -1,
               partition: Optional[str] = None) -> None:
        self._store.expect(request_id, partition)
        super().submit(request_id, prompt, sampling, index)

    def poll(self, timeout: float = 0.0, max_groups: Optional[int] = None, only: Optional[list[str]] = None) -> list:
        return self._store.put(super().poll(timeout, max_groups, only))

    def carry(self, request_ids: list[str], partition: str) -> None:
        """Groups in flight go to another partition when they finish (the rollout manager's next
        collection takes them over: trainer.partial_rollout in async mode)."""
        self._store.carry(request_ids, partition)

    def generate(self, prompts: list[Prompt], sampling: Sampling, partition: Optional[str] = None) -> list:
        groups = super().generate(prompts, sampling)
        for g in groups:
            self._store.expect(g.request_id, partition)
        return self._store.put(groups)


class GroupStore:
    """Finished groups -> the data plane; a request submitted without a partition (or an actor
    without a data plane) returns its RolloutGroup whole, as the bare `Engine` does."""

    def __init__(self, data_plane, name: str):
        self.plane = dataplane.connect(data_plane) if data_plane is not None else None
        self.name = name or f"engine{os.getpid()}"
        self.partitions: dict[str, str] = {}

    def expect(self, request_id: str, partition: Optional[str]) -> None:
        if partition is not None:
            if self.plane is None:
                raise ValueError("this engine has no data plane; start it with data_plane=")
            self.partitions[request_id] = partition

    def carry(self, request_ids: list[str], partition: str) -> None:
        for rid in request_ids:
            if rid in self.partitions:  # stored at the poll that returns it, never before
                self.partitions[rid] = partition

    def put(self, groups: list[RolloutGroup]) -> list:
        """Store the groups' rows with one data-plane put per partition (not one per group: a put
        is a round trip to the storage units, and a poll returns many groups)."""
        out, batches = [], {}  # (partition, row kind) -> (keys, rows)
        for g in groups:
            partition = self.partitions.pop(g.request_id, None)
            if partition is None:
                out.append(g)
                continue
            if g.aborted:  # nobody trains on it: only its lengths go back, nothing is stored
                out.append(g.stored(partition, []))
                continue
            prefix = row_prefix(self.name, g.request_id)
            keys, rows, image_row = [f"{prefix}{j}" for j in range(len(g.responses))], g.rows(), g.image_row()
            self._add(batches, (partition, "responses"), keys, rows)
            fields = tuple(rows[0])
            if image_row is not None:  # the prompt's pixels, once for its n responses
                self._add(batches, (partition, "images"), [f"{prefix}images"], [image_row])
                fields += tuple(image_row)
            out.append(g.stored(partition, keys, fields, f"{prefix}images" if image_row is not None else ""))
        for (partition, _), (keys, rows) in batches.items():
            self.plane.put(partition, keys, rows, writer="rollout")
        return out

    @staticmethod
    def _add(batches: dict, where: tuple[str, str], keys: list[str], rows: list[dict]) -> None:
        """Queue rows for one put per (partition, row kind): image rows have columns of their own."""
        batch = batches.setdefault(where, ([], []))
        batch[0].extend(keys)
        batch[1].extend(rows)


def engine_actor(spec: EngineSpec, *, device: str = "auto", name: Optional[str] = None,
                 log_path: Optional[str] = None, data_plane=None, **ray_options):
    """Start one engine actor for `spec`; returns its handle (methods as on `Engine`, called with .remote()).

    ray_options: the actor's resources and placement (`Device.ray_options`, a scheduling
    strategy). log_path: where the engine's library output goes (None: the console). data_plane:
    a `dataplane.Handle` (calls with a partition then return StoredGroups). The device
    layer's host and vLLM environments go into the actor's runtime env, so they are set before
    the process's first allocation and vLLM's import.
    """
    import ray
    dev = get_device(device)
    env = {**dev.host_env(), **dev.vllm_env(spec.rollout.parallel.tp),
           **(dev.deterministic_env(engine=True) if spec.deterministic else {})}
    options = dict(ray_options, max_concurrency=MAX_CONCURRENCY, runtime_env={"env_vars": env})
    if name is not None:
        options["name"] = name
    return ray.remote(EngineActor).options(**options).remote(
        spec, device=device, log_path=log_path, data_plane=data_plane, name=name or "")
