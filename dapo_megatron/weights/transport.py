"""Weight-sync transports: how buckets of (hf_name, tensor) get from trainer ranks into every engine.

One class per transport holds both sides and their set-up; `TRANSPORTS` maps
`rollout.sync.transport` to it (a CUDA-IPC or RDMA transport is one more class and one more row).
Each process that takes part, a trainer rank or an engine, keeps one instance: it holds what
outlives a sync (process groups). One sync, in call order:

    trainer rank:  address = t.listen(sends)                  # where receivers connect, or None
    driver:        receiving = T.start_receivers(engines, addresses)   # Ray calls, may be []
    trainer rank:  sender = t.sender(engines, address); weights.sync.push(..., sender, ...); sender.close()
    engine:        t.receive(address, rank, size, load)       # inside Engine.receive_weights

object_store: each bucket is `ray.put` once and every engine's `load_weights` reads it from the
    object store (zero-copy into an in-process model on the same node); one bucket in flight, so
    exporting the next overlaps the engines' loading of this one. Host memory, any device.
broadcast: each sending trainer rank hosts its own process group (rank 0) with the engines
    (ranks 1..E), built from a TCPStore it hosts, outside the training world, by the device layer
    (gloo on CPU, NCCL on CUDA, HCCL on NPU). One group per sender because senders export in
    lockstep (TP / expert-TP gathers): a sender waiting for another's turn would block the
    gathers that other needs. An engine receives each group on its own thread. Per bucket the
    sender broadcasts a header (its length, then names, shapes, dtypes as JSON) and one flat byte
    buffer holding every tensor; a header of length 0 ends the stream. Tensors move device to
    device where the backend can, never through the driver.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Callable, Optional, Protocol

import torch
import torch.distributed as dist

from dapo_megatron.parallel import free_port

Bucket = list[tuple[str, torch.Tensor]]
Address = tuple[str, int]


class Sender(Protocol):
    """One trainer rank's side of one sync."""

    def send(self, bucket: Bucket) -> None:
        """Start moving one bucket; its tensors are not modified afterwards."""

    def flush(self) -> None:
        """Wait until every bucket sent so far is loaded by every engine."""

    def close(self) -> None:
        """End this rank's part of the sync (after the last flush)."""

    dead: set  # engines (indices) that died in this sync and got no later bucket; the others synced


# ---- object store -----------------------------------------------------------------------------


class _ObjectStoreSender:
    """An engine that dies in the sync is left out of the later buckets (`dead`): the others'
    sync goes on, and the driver replaces it (driver/recovery.py)."""

    def __init__(self, engines: list):
        self.engines, self.pending, self.dead = engines, [], set()

    def send(self, bucket: Bucket) -> None:
        import ray
        ref = ray.put([(name, t.detach().cpu()) for name, t in bucket])
        self.flush()
        self.pending = [(i, e.load_weights.remote(ref)) for i, e in enumerate(self.engines) if i not in self.dead]

    def flush(self) -> None:
        import ray
        for i, ref in self.pending:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                self.dead.add(i)
        self.pending = []

    def close(self) -> None:
        self.flush()


class ObjectStoreTransport:
    """Buckets through Ray's object store; engines are sent `load_weights` calls, no set-up."""

    def __init__(self, device):
        self.device = device

    def listen(self, sends: bool) -> Optional[Address]:
        return None

    @staticmethod
    def start_receivers(engines: list, addresses: list[Optional[Address]]) -> list:
        return []

    def sender(self, engines: list, address: Optional[Address]) -> Sender:
        return _ObjectStoreSender(engines)

    def receive(self, address: Address, rank: int, size: int, load: Callable[[Bucket], int]) -> int:
        raise RuntimeError("the object_store transport has no receiving side: engines get load_weights calls")


# ---- broadcast ------------------------------------------------------------------------------

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def connect(device, host: str, port: int, rank: int, size: int, timeout_s: float = 600.0):
    """Join the group whose store rank 0 hosts at host:port; a rendezvous of all `size` members."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    return device.new_group(store, rank, size, timeout)


def _broadcast(group, tensor: torch.Tensor) -> None:
    group.broadcast(tensor, 0).wait()


def _padded(nbytes: int) -> int:
    """Each tensor starts 8-byte aligned in the flat buffer, so it can be viewed as any dtype."""
    return (nbytes + 7) // 8 * 8


class _BroadcastSender:
    dead: set = frozenset()  # an engine that dies fails the group's broadcast: the sync stops

    def __init__(self, group, device):
        self.group, self.where = group, device.current_device()
        self.bytes_sent = 0

    def send(self, bucket: Bucket) -> None:
        entries, parts = [], []
        for name, t in bucket:
            data = t.detach().contiguous().reshape(-1).view(torch.uint8)
            entries.append((name, list(t.shape), str(t.dtype)))
            parts += [data, data.new_zeros(_padded(data.numel()) - data.numel())]
        self._send_header(json.dumps(entries).encode())
        flat = torch.cat(parts).to(self.where)
        _broadcast(self.group, flat)
        self.bytes_sent += flat.numel()

    def _send_header(self, header: bytes) -> None:
        _broadcast(self.group, torch.tensor([len(header)], dtype=torch.int64, device=self.where))
        if header:
            _broadcast(self.group, torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.where))

    def flush(self) -> None:
        """Broadcasts are synchronous: a bucket is in every engine's buffer once `send` returns."""

    def close(self) -> None:
        """End the stream: the engines' `receive` returns."""
        self._send_header(b"")


class _NoSender:
    """A rank that owns no tensor to send: it takes part in the export's gathers only."""
    dead: set = frozenset()

    def send(self, bucket: Bucket) -> None:
        raise RuntimeError("weight sync: a rank with no broadcast group was given a bucket to send")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _receive_bucket(group, where: torch.device) -> Optional[Bucket]:
    """The next bucket, as views into one freshly allocated buffer; None once the sender closed."""
    size = torch.zeros(1, dtype=torch.int64, device=where)
    _broadcast(group, size)
    if int(size.item()) == 0:
        return None
    header = torch.empty(int(size.item()), dtype=torch.uint8, device=where)
    _broadcast(group, header)
    entries = json.loads(bytes(header.cpu().numpy()).decode())
    sizes = [torch.Size(shape).numel() * _DTYPES[dtype].itemsize for _, shape, dtype in entries]
    flat = torch.empty(sum(_padded(n) for n in sizes), dtype=torch.uint8, device=where)
    _broadcast(group, flat)
    bucket, offset = [], 0
    for (name, shape, dtype), n in zip(entries, sizes):
        bucket.append((name, flat[offset:offset + n].view(_DTYPES[dtype]).reshape(shape)))
        offset += _padded(n)
    return bucket


class BroadcastTransport:
    """One process group per sending trainer rank with every engine (see the module docstring).
    Groups are built by the first sync (a rendezvous, and an NCCL / HCCL communicator set-up)
    and kept on both sides."""

    def __init__(self, device):
        self.device = device
        self._address: Optional[Address] = None  # trainer rank: where its group's store listens
        self._group = None  # trainer rank: its group, rank 0
        self._groups: dict[tuple, object] = {}  # engine: (address, rank, size) -> group

    def listen(self, sends: bool) -> Optional[Address]:
        """Trainer rank: its group's address if it sends anything (fixed at the first call)."""
        if sends and self._address is None:
            import ray
            self._address = (ray.util.get_node_ip_address(), free_port(""))
        return self._address if sends else None

    @staticmethod
    def start_receivers(engines: list, addresses: list[Optional[Address]]) -> list:
        """Driver: every engine starts receiving from every sending rank (one Ray call each,
        blocking on its own actor thread until that sender closes)."""
        size = len(engines) + 1
        return [e.receive_weights.remote(a, i + 1, size) for a in addresses if a is not None
                for i, e in enumerate(engines)]

    def sender(self, engines: list, address: Optional[Address]) -> Sender:
        """Trainer rank: the sender of this sync (joins the group at the first one)."""
        if address is None:
            return _NoSender()
        if self._group is None:
            self._group = connect(self.device, *address, rank=0, size=len(engines) + 1)
        return _BroadcastSender(self._group, self.device)

    def receive(self, address: Address, rank: int, size: int, load: Callable[[Bucket], int]) -> int:
        """Engine: receive buckets from one sender until it closes, `load` each; returns tensors
        loaded. Bucket i loads on a second thread while bucket i+1 arrives (the sender's next
        gather and broadcast overlap the engine's load, as with one object-store bucket in flight)."""
        key = (tuple(address), rank, size)
        if key not in self._groups:
            self._groups[key] = connect(self.device, *address, rank, size)
        group, where = self._groups[key], self.device.current_device()
        loaded, pending = 0, None
        with ThreadPoolExecutor(1, thread_name_prefix="weight-load") as loader:
            while True:
                bucket = _receive_bucket(group, where)
                if pending is not None:
                    loaded += pending.result()
                if bucket is None:
                    return loaded
                pending = loader.submit(load, bucket)


TRANSPORTS = {"object_store": ObjectStoreTransport, "broadcast": BroadcastTransport}

