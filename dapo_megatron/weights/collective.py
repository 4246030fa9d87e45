"""Weight-sync transport over a process group between one trainer rank and the engines.

Each sending trainer rank (see `sync.sender_roles`) gets its own group: rank 0 is the sender,
ranks 1..E the engines; it is built from a TCPStore the sender hosts, outside the training
world, by the device layer (gloo on CPU, NCCL on CUDA, HCCL on NPU). One group per sender
because senders export in lockstep (TP / expert-TP gathers): a sender waiting for another's
turn would block the gathers that other needs. An engine receives each group on its own thread.

Per bucket the sender broadcasts a header (its length, then names, shapes, dtypes as JSON) and one
flat byte buffer holding every tensor of the bucket; a header of length 0 ends the stream. The
tensors move device to device where the backend can (NCCL / HCCL), never through the driver.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

Bucket = list[tuple[str, torch.Tensor]]
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def connect(device, host: str, port: int, rank: int, size: int, timeout_s: float = 600.0):
    """Join the group whose store the sender (rank 0) hosts at host:port; a rendezvous of all
    `size` members, so every member must call it."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    return device.new_group(store, rank, size, timeout)


def _broadcast(group, tensor: torch.Tensor) -> None:
    group.broadcast(tensor, 0).wait()


def _padded(nbytes: int) -> int:
    """Each tensor starts 8-byte aligned in the flat buffer, so it can be viewed as any dtype."""
    return (nbytes + 7) // 8 * 8


class BroadcastSender:
    """`sync.Transport` for one sender: broadcasts every bucket to the group's engines."""

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


def receive(group, device, load: Callable[[Bucket], int]) -> int:
    """Engine side: receive buckets until the sender closes, `load` each; returns tensors loaded.
    Bucket i loads on a second thread while bucket i+1 arrives (the sender's next gather and
    broadcast overlap the engine's load, as with one object-store bucket in flight)."""
    where = device.current_device()
    loaded, pending = 0, None
    with ThreadPoolExecutor(1, thread_name_prefix="weight-load") as loader:
        while True:
            bucket = _receive_bucket(group, where)
            if pending is not None:
                loaded += pending.result()
            if bucket is None:
                return loaded
            pending = loader.submit(load, bucket)
