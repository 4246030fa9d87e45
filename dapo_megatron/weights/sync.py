"""Weight sync, trainer side: what each rank sends to the rollout engines, in HF names, bucketed.

A push is a collective over all ranks of the model (TP and expert-TP all-gathers happen on the
way), but each HF tensor leaves the trainer once, from the rank that owns it:
- non-expert tensors are TP-gathered and sent by TP rank 0 of DP / CP replica 0 of each stage;
- experts are not gathered over EP: every EP rank sends its own (expert-TP rank 0 of expert-DP
  replica 0) under global expert ids, so EP adds no gather traffic and no rank holds all experts.
A `transport.Sender` moves one bucket to every engine (`weights/transport.py`); the engines
buffer a fused layer until all its parts arrived, whichever rank sent them. The names, shapes and dtypes sent are recorded on the
first push (`SyncPlan`); a later push that sends anything else fails naming the tensor, since a
silently missing tensor is a stale weight in the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from dapo_megatron.parallel import coords
from dapo_megatron.weights.checksum import Checksum, tensor_checksum
from dapo_megatron.weights.export import bucketize, is_dense_owner, iter_hf_params
from dapo_megatron.weights.transport import Sender


def sender_roles() -> tuple[bool, bool]:
    """(sends non-expert tensors, sends its experts) for this rank."""
    c = coords()
    return is_dense_owner(), c.etp_rank == 0 and c.edp_rank == 0


def owned_tensors(model_chunks) -> Iterator[tuple[str, torch.Tensor]]:
    """The (hf_name, full tensor) pairs this rank sends; a collective: every rank iterates it all."""
    dense, experts = sender_roles()
    for pm, tensors in iter_hf_params(model_chunks, experts="owner"):
        if experts if pm.is_expert else dense:
            yield from tensors.items()


@dataclass
class SyncPlan:
    """What one rank sends per push: {hf_name: (shape, dtype)}, fixed after the first push."""
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(torch.Size(s).numel() * d.itemsize for s, d in self.tensors.values())

    def check(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.tensors:
            raise RuntimeError(f"weight sync: {name} was not sent by the first push of this rank")
        if (tuple(tensor.shape), tensor.dtype) != self.tensors[name]:
            raise RuntimeError(f"weight sync: {name} is {tuple(tensor.shape)} {tensor.dtype}, the first push "
                               f"sent {self.tensors[name]}")


def push(model_chunks, sender: Sender, bucket_bytes: int, plan: Optional[SyncPlan] = None,
         checksums: bool = False) -> tuple[dict[str, Checksum], SyncPlan]:
    """Send this rank's tensors through `sender`; returns the plan (pass the first push's to
    later ones) and, with `checksums`, per-tensor checksums of what was sent (else {}: they cost
    a float64 pass over every weight, so only syncs that are verified pay it)."""
    first, plan = plan is None, plan or SyncPlan()
    sums: dict[str, Checksum] = {}
    sent: set[str] = set()
    for bucket in bucketize(owned_tensors(model_chunks), bucket_bytes):
        for name, t in bucket:
            if first:
                plan.tensors[name] = (tuple(t.shape), t.dtype)
            else:
                plan.check(name, t)
            sent.add(name)
        sender.send(bucket)
        if checksums:
            sums.update((name, tensor_checksum(t)) for name, t in bucket)
    sender.flush()
    missing = sorted(set(plan.tensors) - sent)
    if missing:
        raise RuntimeError(f"weight sync: {len(missing)} tensors of the first push were not sent, e.g. {missing[:3]}")
    return sums, plan
