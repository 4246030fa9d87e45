"""Training ranks as Ray actors, and the group that calls them with explicit methods.

One `TrainWorker` per Megatron rank holds this rank's actor (and reference, when a KL term
needs it; it shares the actor's ranks and parallel state). `TrainGroup` fans each call out to
every rank and returns rank 0's answer: every rank computes the same full results, and every rank
must take part because the calls are collectives.
"""
from __future__ import annotations

import os
import socket
from typing import Optional

import ray

from dapo_megatron.batch import RolloutBatch
from dapo_megatron.config.schema import DapoConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RayBroadcast:
    """Weight-sync transport: one `ray.put` per bucket that every engine loads from the object
    store (zero-copy into an engine's in-process model on the same node). One bucket stays in
    flight, so exporting the next bucket overlaps the engines' loading of this one."""

    def __init__(self, engines: list):
        self.engines, self.pending = engines, []

    def send(self, bucket: list) -> None:
        ref = ray.put([(name, t.detach().cpu()) for name, t in bucket])
        self.flush()
        self.pending = [e.load_weights.remote(ref) for e in self.engines]

    def flush(self) -> None:
        ray.get(self.pending)
        self.pending = []


class TrainWorker:
    def __init__(self, cfg: DapoConfig, model_path: str, rank: int, world_size: int):
        self.cfg, self.model_path, self.rank, self.world_size = cfg, model_path, rank, world_size
        self.actor = self.ref = None
        self.sync_plan = None  # what this rank sends per weight sync, fixed by the first one
        self._sync_address = self._sync_group = None  # broadcast transport: made by the first sync

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the process group (asked of rank 0 only)."""
        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, master: tuple[str, int], total_steps: int) -> dict:
        """Join the process group, initialise Megatron's parallel state, build the models."""
        from dapo_megatron.device import get_device
        from dapo_megatron.train.actor import Actor
        from dapo_megatron.train.parallel import init_parallel
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.rank % self.cfg.trainer.n_gpus_per_node))
        self.device = device = get_device(self.cfg.trainer.device)
        device.setup_process(self.cfg.trainer.n_gpus_per_node)
        info = init_parallel(self.cfg.actor.parallel, device, seed=self.cfg.trainer.seed)
        c = self.cfg
        self.actor = Actor(c.actor, self.model_path, n=c.rollout.n, total_steps=total_steps, dtype=c.model.dtype,
                           temperature=c.rollout.temperature)
        if c.actor.use_kl_loss:
            from dapo_megatron.train.reference import Reference
            self.ref = Reference(c.ref, self.model_path, dtype=c.model.dtype, temperature=c.rollout.temperature,
                                 max_tokens_per_microbatch=c.actor.max_tokens_per_microbatch)
        return vars(info)

    def compute_logprobs(self, batch: RolloutBatch) -> dict:
        return self.actor.compute_logprobs(batch)

    def compute_ref_logprobs(self, batch: RolloutBatch):
        return self.ref.compute_logprobs(batch)

    def update(self, batch: RolloutBatch) -> dict:
        return self.actor.update(batch)

    def sync_address(self) -> Optional[tuple[str, int]]:
        """Where this rank hosts its broadcast group for weight syncs, or None when it sends
        nothing (weights/sync.sender_roles). Fixed at the first call: the group outlives a sync."""
        from dapo_megatron.weights.sync import sender_roles
        if self._sync_address is None and any(sender_roles()):
            self._sync_address = (ray.util.get_node_ip_address(), _free_port())
        return self._sync_address

    def push_weights(self, engines: list, bucket_mb: int, checksums: bool,
                     address: Optional[tuple[str, int]] = None) -> tuple[dict, int]:
        """Send the tensors this rank owns (weights/sync.py) into every engine; returns their
        checksums (with `checksums`) and bytes. A collective: every rank takes part in the TP /
        expert-TP gathers. With `address` the buckets go over this rank's broadcast group
        (weights/collective.py), else through the object store."""
        from dapo_megatron.weights import collective
        from dapo_megatron.weights.sync import push
        if address is None:  # also a rank that sends nothing in broadcast mode: it only gathers
            transport = RayBroadcast(engines)
        else:  # the first sync builds the group (a rendezvous with every engine); later ones reuse it
            if self._sync_group is None:
                self._sync_group = collective.connect(self.device, *address, rank=0, size=len(engines) + 1)
            transport = collective.BroadcastSender(self._sync_group, self.device)
        sums, self.sync_plan = push(self.actor.chunks, transport, bucket_mb << 20, self.sync_plan,
                                    checksums=checksums)
        if address is not None:
            transport.close()
        return sums, self.sync_plan.nbytes

    def save_hf(self, out_dir: str, shard_mb: int = 2048) -> dict:
        """Write the current weights as HF safetensors shards (one writer per stage); returns
        the writer's weight map (empty on non-writers). For checks and exports, not the loop."""
        from dapo_megatron.weights.export import write_hf_shards
        return write_hf_shards(self.actor.chunks, out_dir, shard_mb << 20)

    def save(self, root: str, step: int, trainer_state: dict, keep: int) -> str:
        from dapo_megatron.train.checkpoint import save_checkpoint
        return save_checkpoint(self.actor, root, step, trainer_state, keep=keep)

    def load(self, path: str, load_optimizer: bool = True) -> dict:
        from dapo_megatron.train.checkpoint import load_checkpoint
        return load_checkpoint(self.actor, path, load_optimizer=load_optimizer)


class TrainGroup:
    """All ranks of the actor (+ reference); each method is one collective call on every rank."""

    def __init__(self, workers: list):
        self.workers = workers

    def _all(self, calls: list):
        return ray.get(calls)

    def setup(self, total_steps: int) -> dict:
        master = ray.get(self.workers[0].address.remote())
        return self._all([w.setup.remote(master, total_steps) for w in self.workers])[0]

    def compute_logprobs(self, batch_ref) -> dict:
        return self._all([w.compute_logprobs.remote(batch_ref) for w in self.workers])[0]

    def compute_ref_logprobs(self, batch_ref):
        return self._all([w.compute_ref_logprobs.remote(batch_ref) for w in self.workers])[0]

    def update(self, batch_ref) -> dict:
        return self._all([w.update.remote(batch_ref) for w in self.workers])[0]

    def push_weights(self, engines: list, bucket_mb: int, checksums: bool,
                     transport: str = "object_store") -> tuple[dict, int]:
        """Every rank sends what it owns; returns all checksums and the bytes sent per engine.
        With the broadcast transport each sending rank hosts a group that every engine joins
        (one receiving thread per sender) while the ranks push."""
        addresses, receiving = [None] * len(self.workers), []
        if transport == "broadcast":
            addresses = self._all([w.sync_address.remote() for w in self.workers])
            senders = [a for a in addresses if a is not None]
            receiving = [e.receive_weights.remote(a, i + 1, len(engines) + 1) for a in senders
                         for i, e in enumerate(engines)]
        sums, nbytes = {}, 0
        pushes = [w.push_weights.remote(engines, bucket_mb, checksums, a) for w, a in zip(self.workers, addresses)]
        # One get over both sides: ray.get raises at the first failure, so an engine that dies
        # mid-receive stops the run now, not after its sender's collective times out.
        for part, n in self._all(pushes + receiving)[:len(pushes)]:
            sums.update(part)
            nbytes += n
        return sums, nbytes

    def save_hf(self, out_dir: str) -> tuple[dict, int]:
        """HF shards of the current weights in out_dir; (weight map, bytes) for `finalize_shards`."""
        weight_map, total = {}, 0
        for part in self._all([w.save_hf.remote(out_dir) for w in self.workers]):
            weight_map.update(part.get("weight_map", {}))
            total += part.get("total_bytes", 0)
        return weight_map, total

    def save(self, root: str, step: int, trainer_state: dict, keep: int) -> str:
        return self._all([w.save.remote(root, step, trainer_state, keep) for w in self.workers])[0]

    def load(self, path: str, load_optimizer: bool = True) -> dict:
        return self._all([w.load.remote(path, load_optimizer) for w in self.workers])[0]
