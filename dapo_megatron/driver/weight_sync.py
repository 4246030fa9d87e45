"""The driver's side of a weight sync: the engines paused, every bucket pushed by the training
ranks through rollout.sync.transport, the engines resumed, and what they hold checksummed."""
from __future__ import annotations

from typing import Optional

import ray

from dapo_megatron import roles
from dapo_megatron.config import DapoConfig
from dapo_megatron.config.schema import SyncConfig
from dapo_megatron.roles import as_role
from dapo_megatron.weights.checksum import checksum_mismatches


def verify_due(cfg: DapoConfig, syncs: int) -> bool:
    every = cfg.rollout.sync.verify_every
    return every > 0 and syncs % every == 0


def sync_weights(train, engines: list, sync: SyncConfig, verify: bool, version: Optional[int] = None,
                 lost: Optional[list[int]] = None) -> dict:
    """Actor -> engines: pause, load every bucket, post-process, reset prefix cache, resume.

    With `verify`, per-tensor checksums of what each engine holds must equal what was sent; a
    mismatch stops training with the tensors' names (silent sync corruption is the failure that
    costs users the most). `version`: the policy version the engines record on every token they
    sample from now on (the driver's count of pushes). `lost`: engines (indices) that die in the
    sync are added to it and the others synced (the caller replaces them); None: such a death
    stops the sync (RoleDied). Returns {"sync/bytes": bytes sent per engine}.
    """
    def each(call) -> list:
        """`call` on every engine not lost, at once; their results (None for the lost)."""
        skip = set(lost or ())
        refs = [(i, None if i in skip else call(e)) for i, e in enumerate(engines)]
        out = []
        for i, ref in refs:
            try:
                out.append(None if ref is None else ray.get(ref))
            except ray.exceptions.RayActorError as exc:
                if lost is None:
                    raise roles.died("rollout engine", exc) from None
                lost.append(i)
                out.append(None)
        return out
    each(lambda e: e.begin_weight_update.remote())
    try:
        sent, nbytes, dead = as_role("actor", train.push_weights, engines, sync.bucket_mb, verify, sync.transport)
    finally:
        each(lambda e: e.finish_weight_update.remote(version))
    for i in dead:
        if lost is None:
            raise roles.died("rollout engine", f"engine {i} died in the weight sync")
        if i not in lost:
            lost.append(i)
    if verify:
        for i, held in enumerate(each(lambda e: e.checksums.remote())):
            bad = [] if held is None else checksum_mismatches(sent, held)
            if bad:
                raise RuntimeError(f"weight sync verification failed on engine {i}: {len(bad)} tensors differ "
                                   f"from the trainer's, e.g. {bad[:5]}")
    return {"sync/bytes": nbytes}
