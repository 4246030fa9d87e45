"""The data plane: a step's rows, by key and field, between the processes that make and read them.

Engines put each finished response's tokens (`prompts`, `responses`, `rollout_logprobs`, and
`loss_mask` / `routed_experts` when they have them; a prompt's images once per group, as an
image row the group's responses point to); the reward worker (in the rollout manager) reads
`responses`; each training rank reads the rows of its DP share and the columns it needs, and,
under PP or CP, puts `old_logprobs` / `ref_logprobs` (and recorded routes) back by column. The
driver sees keys and small per-response metadata only (`StepBatch`), and has the manager, which
started the data plane, clear a step's partition when the update consumed it. This is the one module that knows TransferQueue (`transfer_queue` on PyPI): its
controller and SimpleStorage units (Ray actors, ZMQ between processes), through its KV interface.

Values are stored per `batch.FIELDS` row: sample fields as [n] tensors, sequence / token /
position fields as jagged nested tensors of each response's own length (token fields unpadded),
so nothing is padded or stored twice; `read_batch` turns a rank's rows back into a RolloutBatch.

Two layouts (trainer.layout): `full` gives the controller and each storage unit a Ray actor of
its own (TransferQueue's own start, for runs over several nodes); `lean` (the default on one node)
hosts them in the starting process, the rollout manager's, as objects whose ZMQ servers run on
threads of their own: two processes fewer (what that saves: bench/process_memory.py), the same
client calls. Clients then read the data plane's addresses from that process's named actor.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from dapo_megatron.batch import FIELDS, IMAGE, SAMPLE, RolloutBatch, step_fields

BACKENDS = ("transfer_queue",)
_BYTES_TAG = "bytes/"  # tags "bytes/<writer>": what each writer stored for a key (resident size)


def process_env() -> dict[str, str]:
    """Environment for every process that talks to the data plane: TransferQueue logs a warning
    on every call when its thread count exceeds the cores, and that is not for the console."""
    import psutil
    cores = psutil.cpu_count(logical=False) or 1
    return {"TQ_LOGGING_LEVEL": "ERROR", "TQ_NUM_THREADS": str(min(8, cores))}


def _transfer_queue():
    """The transfer_queue module, imported quietly (it reads its environment at import)."""
    for key, value in process_env().items():
        os.environ.setdefault(key, value)
    import transfer_queue as tq
    logging.getLogger("transfer_queue").setLevel(logging.ERROR)
    return tq


def ray_cpus(cfg, here: bool = False) -> int:
    """Ray CPUs the data plane's actors ask for (controller + storage units, mostly idle on ZMQ):
    a local Ray is started advertising these on top of the machine's cores. 0 when `here`
    (the lean layout: no actor of its own)."""
    return 0 if here else 1 + cfg.storage_units


@dataclass(frozen=True)
class Handle:
    """What a process needs to reach the data plane (picklable). `host`: the named Ray actor whose
    process hosts it (the lean layout) and answers `data_plane_config()`; "" : TransferQueue's own
    named controller (the full layout)."""
    backend: str = "transfer_queue"
    host: str = ""


_HOSTED: dict = {}  # the lean layout's host: "conf" (what clients attach with), "units" (storage units)


def hosted_config():
    """The hosting process's TransferQueue config (the controller's and units' ZMQ addresses):
    what `data_plane_config()` of the host actor returns to a client attaching."""
    return _HOSTED["conf"]


def start(cfg, host: str = "") -> Handle:
    """Start the controller and storage units (once, by the rollout manager, after Ray is up):
    as Ray actors of their own, or, given `host` (this process's actor name), in this process
    (the lean layout). Returns the handle that reaches them."""
    import ray
    here = bool(host)
    # TransferQueue's actors wait forever for CPUs the cluster does not have: say so instead.
    free = ray.available_resources().get("CPU", 0)
    if free < ray_cpus(cfg, here):
        raise RuntimeError(
            f"the data plane needs {ray_cpus(cfg)} free Ray CPUs (its controller and data_plane.storage_units="
            f"{cfg.storage_units} storage units) and the cluster has {free:g}: start Ray with more "
            f"(`ray start --num-cpus=...`) or lower data_plane.storage_units")
    tq = _transfer_queue()
    # A run before this one in the same process (tests, notebooks) leaves TransferQueue's module
    # state pointing at a controller of a Ray that is gone: forget it, and our clients with it.
    # (tq.close() gives up half-way on handles of a dead Ray, so its globals are reset here.)
    try:
        tq.close()
    except Exception:  # noqa: BLE001 - whatever the stale handles raise, they are dropped
        pass
    import transfer_queue.interface as tq_state
    tq_state._TQ_CLIENT = tq_state._TQ_STORAGE = tq_state._TQ_CONTROLLER = None
    _forget_hosted()
    # TransferQueue pins its storage units round-robin to the cluster's alive nodes; a head started
    # with no CPU (`ray start --head --num-cpus=0`) could take one it never schedules: only nodes
    # with CPUs are eligible.
    simple = {"num_data_storage_units": cfg.storage_units, "required_node_resource": "CPU"}
    if cfg.capacity:
        simple["total_storage_size"] = cfg.capacity
    conf = {"backend": {"storage_backend": "SimpleStorage", "SimpleStorage": simple}}
    if here:
        _host_here(tq_state, conf)
    else:
        tq.init(conf)
    return Handle(cfg.backend, host)


def _host_here(tq_state, user_conf: dict) -> None:
    """What `tq.init` does, with the controller and storage units built in this process from the
    classes under TransferQueue's Ray decorators (their servers are ZMQ sockets on threads; Ray
    only started them): the same config, addresses and client, no process of their own."""
    from importlib import resources
    from uuid import uuid4

    from omegaconf import OmegaConf
    from transfer_queue.storage.simple_storage import SimpleStorageUnit
    conf = OmegaConf.merge(OmegaConf.create({}, flags={"allow_objects": True}),
                           OmegaConf.load(resources.files("transfer_queue") / "config.yaml"), user_conf)
    controller = _unwrapped(tq_state.TransferQueueController)(
        sampler=getattr(tq_state, conf.controller.sampler), polling_mode=conf.controller.polling_mode)
    conf.controller.zmq_info = controller.get_zmq_server_info()
    simple = dict(conf.backend.SimpleStorage, _run_id=uuid4().hex)
    units = {f"TransferQueueStorageUnit#{i}": _unwrapped(SimpleStorageUnit)(config=simple)
             for i in range(simple["num_data_storage_units"])}
    conf.backend.SimpleStorage.zmq_info = {name: unit.get_zmq_server_info() for name, unit in units.items()}
    controller.store_config(conf)
    _HOSTED.update(conf=conf, controller=controller, units=units)  # the controller kept alive with them
    tq_state._maybe_create_tq_client(conf)


def _unwrapped(actor_class):
    """The class a `@ray.remote` decorated (Ray keeps it as the actor's original class)."""
    return actor_class.__ray_metadata__.modified_class.__ray_actor_class__


def start_in_background(cfg, host: str = "") -> Future:
    """`start` in a thread of its own, while the caller goes on with its own start-up: the
    controller and then the storage units start in processes of their own (~8 s on 2 cores, waited
    on by TransferQueue's init). TransferQueue is imported first, on the caller's thread: two
    threads importing the same packages at once can deadlock on Python's import locks."""
    _transfer_queue()
    pool = ThreadPoolExecutor(1, thread_name_prefix="data-plane-start")
    future = pool.submit(start, cfg, host)
    pool.shutdown(wait=False)
    return future


def stop() -> None:
    _transfer_queue().close()
    _forget_hosted()


def _forget_hosted() -> None:
    """Our clients dropped, and the storage units this process hosts stopped (the controller's
    threads are daemons: they go with the process)."""
    for unit in _HOSTED.pop("units", {}).values():
        unit.shutdown()
    _HOSTED.clear()
    _CLIENTS.clear()


_CLIENTS: dict[Handle, "DataPlane"] = {}


def connect(handle: Handle) -> "DataPlane":
    """This process's client (created on first use; a later call returns the same one)."""
    if handle not in _CLIENTS:
        _CLIENTS[handle] = DataPlane(handle)
    return _CLIENTS[handle]


def attach(handle: Handle):
    """TransferQueue with this process's client attached: to the host actor's data plane (lean; the
    host itself attached when it started), else to TransferQueue's named controller."""
    tq = _transfer_queue()
    import transfer_queue.interface as tq_state
    if tq_state._TQ_CLIENT is None:
        if handle.host:
            import ray
            conf = ray.get(ray.get_actor(handle.host).data_plane_config.remote())
            tq_state._maybe_create_tq_client(conf)
        else:
            tq.init()
    return tq


def _nbytes(value) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


class DataPlane:
    """put / get / clear rows by key within a partition; counts the bytes this process moved."""

    def __init__(self, handle: Handle):
        self._handle, self._client = handle, None
        self.bytes_put = self.bytes_get = 0

    @property
    def _tq(self):
        """TransferQueue, attached to the controller on first use, not at construction: the
        roles are created while the rollout manager still starts the controller and units, so
        the start-ups overlap (~5 s of a quickstart's start on 2 cores)."""
        if self._client is None:
            self._client = attach(self._handle)
        return self._client

    def put(self, partition: str, keys: Sequence[str], rows: Sequence[dict], writer: str) -> int:
        """Store `rows` (one dict per key: FIELDS name -> value) under `keys`; adds columns to keys
        that exist. Returns the bytes stored. `writer` names the bytes in the keys' tags."""
        from tensordict import TensorDict
        if len(keys) != len(rows) or not rows:
            raise ValueError(f"data plane put: {len(keys)} keys for {len(rows)} rows")
        names = list(rows[0])
        columns, sizes = {}, [0] * len(rows)
        for name in names:
            f = FIELDS[name]
            if f.dtype is None:
                raise ValueError(f"field {name!r} holds Python values: it is metadata, not data plane content")
            values = [torch.as_tensor(r[name], dtype=f.dtype) for r in rows]
            for i, v in enumerate(values):
                sizes[i] += _nbytes(v)
            columns[name] = (torch.stack(values) if f.scope == SAMPLE
                             else torch.nested.nested_tensor(values, layout=torch.jagged))
        tags = [{_BYTES_TAG + writer: n} for n in sizes]
        self._tq.kv_batch_put(keys=list(keys), partition_id=partition,
                              fields=TensorDict(columns, batch_size=len(rows)), tags=tags)
        self.bytes_put += sum(sizes)
        return sum(sizes)

    def get(self, partition: str, keys: Sequence[str], fields: Sequence[str]) -> list[dict]:
        """The rows of `keys`, in that order: per row, FIELDS name -> a Python scalar (sample
        fields) or that response's tensor (sequence, token and position fields)."""
        if not keys:
            return []
        data = self._tq.kv_batch_get(keys=list(keys), partition_id=partition, select_fields=list(fields))
        rows: list[dict] = [{} for _ in keys]
        for name in fields:
            if name not in data.keys():
                raise KeyError(f"data plane partition {partition!r} has no field {name!r} for keys {list(keys)[:3]}")
            column = data[name]
            values = column.tolist() if FIELDS[name].scope == SAMPLE else list(column.unbind())
            if len(values) != len(keys):
                raise RuntimeError(f"data plane get of {name!r}: {len(values)} rows for {len(keys)} keys")
            for row, value in zip(rows, values):
                row[name] = value
                self.bytes_get += _nbytes(value) or 4
        return rows

    def clear(self, partition: str, keys: Optional[Sequence[str]] = None) -> None:
        """Drop `keys` from the controller and the storage units; None: the whole partition.

        A partition whose keys were all cleared stays in the controller (its status tensors and
        key maps: ~44 kB a step, one partition per step); clearing it whole removes it."""
        if keys is None:
            if partition in self._tq.get_client().get_partition_list():
                self._tq.get_client().clear_partition(partition)
        elif keys:
            self._tq.kv_clear(keys=list(keys), partition_id=partition)

    def keys(self, partition: str) -> list[str]:
        """The keys `partition` holds now (a metadata call to the controller)."""
        return list(self._tq.kv_list(partition).get(partition, {}))

    def partitions(self) -> list[str]:
        """The partitions the controller holds now."""
        return list(self._tq.get_client().get_partition_list())

    def resident_bytes(self) -> int:
        """Bytes the data plane holds now, over every partition (from the writers' tags)."""
        return int(sum(v for part in self._tq.kv_list().values() for tags in part.values()
                       for k, v in tags.items() if k.startswith(_BYTES_TAG)))

    def pop_counters(self) -> dict[str, int]:
        out = {"bytes_put": self.bytes_put, "bytes_get": self.bytes_get}
        self.bytes_put = self.bytes_get = 0
        return out


@dataclass
class StepBatch:
    """The driver's view of a step's batch: keys and per-response metadata, never tokens.

    Row i is the response stored under keys[i]; `group` numbers its prompt within the step.
    Training ranks turn their rows into a RolloutBatch with `read_batch`.
    """
    partition: str
    keys: list[str]
    group: list[int]
    sequence_lengths: list[int]  # prompt + response, per response (the DP split and packing use it)
    response_lengths: list[int]
    loss_tokens: list[int]  # tokens the loss sees per response (its loss-mask sum)
    scores: list[float]
    acc: list[bool]
    fields: tuple[str, ...]  # the columns stored for every row (engine's, then ranks' write-backs)
    advantages: list[float] = field(default_factory=list)
    # Per response, the key of its prompt's image row (pixel_values, image_grid_thw); "" for a
    # text prompt. Empty for a text-only step.
    image_keys: list[str] = field(default_factory=list)
    # Per response, the policy versions of its oldest and newest token (the engine's record;
    # they differ when a weight push reached it mid-generation).
    versions: list[tuple[int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.keys)


def read_batch(plane: DataPlane, step: StepBatch, rows: Sequence[int], fields: Sequence[str],
               cache: Optional[dict] = None) -> RolloutBatch:
    """The RolloutBatch of `rows` of the step (in that order): `fields` from the data plane (those
    stored), the StepBatch metadata fields (`batch.step_fields`: group, scores, acc, advantages)
    from `step`. With `cache` (key -> the row's fields, kept by the caller for one step) a row's
    field is read from the plane once per step however many passes ask for it."""
    cache = {} if cache is None else cache
    stored = [f for f in fields if f in step.fields]
    images = [f for f in stored if FIELDS[f].scope == IMAGE]
    keys = [step.keys[i] for i in rows]
    _fill(plane, step.partition, keys, [f for f in stored if f not in images], cache)
    samples = [{f: cache[k][f] for f in stored if f not in images} for k in keys]
    if images and step.image_keys:
        _read_images(plane, step, rows, images, samples, cache)
    for i, sample in zip(rows, samples):
        for name in step_fields():
            values = getattr(step, name)
            if values:  # advantages: set by the driver before the update
                sample[name] = values[i]
    return RolloutBatch.from_samples(samples)


def _fill(plane: DataPlane, partition: str, keys: Sequence[str], fields: Sequence[str], cache: dict) -> None:
    """Read what `cache` lacks of `fields` for `keys`: one get per set of missing fields."""
    wanted: dict[tuple[str, ...], list[str]] = {}
    for k in dict.fromkeys(keys):
        missing = tuple(f for f in fields if f not in cache.get(k, {}))
        if missing:
            wanted.setdefault(missing, []).append(k)
    for missing, ks in wanted.items():
        for k, row in zip(ks, plane.get(partition, ks, list(missing))):
            cache.setdefault(k, {}).update(row)


def _read_images(plane: DataPlane, step: StepBatch, rows: Sequence[int], fields: Sequence[str],
                 samples: list[dict], cache: dict) -> None:
    """Add the image fields to `samples`: each image row is read once however many of the rows
    share it (a group's n responses), and a text prompt's rows get empty ones ([0, ...])."""
    keys = [step.image_keys[i] for i in rows]
    unique = sorted({k for k in keys if k})
    if not unique:
        return
    _fill(plane, step.partition, unique, fields, cache)
    empty = {name: cache[unique[0]][name][:0] for name in fields}
    for sample, key in zip(samples, keys):
        sample.update({name: cache[key][name] for name in fields} if key else empty)
