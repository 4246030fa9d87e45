"""The training rank's Ray actor: one `TrainWorker` per Megatron rank holds this rank's actor (and
reference, when a KL term needs it; it shares the actor's ranks and parallel state). The driver
fans each call out to every rank (`driver/workers.TrainGroup`). In the loop (`step_logprobs`,
`step_update`) each rank reads the rows of its DP share from the data plane and writes its
log-probs back there by column; only metrics come back.

The driver defines the actor class from this module: what it imports stays torch-level, as the
train/ and weights/ modules import Megatron inside the functions that run in the rank's process.
"""
from __future__ import annotations

import os
from typing import Optional

import ray

from dapo_megatron import dataplane, heap
from dapo_megatron.algo import rollout_logprob_metrics
from dapo_megatron.batch import READ_BY_LOGPROBS, READ_BY_UPDATE, RolloutBatch, read_by, unpad_positions
from dapo_megatron.config.schema import DapoConfig
from dapo_megatron.device import get_device
from dapo_megatron.logs import redirect_output
from dapo_megatron.models import ModelSpec
from dapo_megatron.parallel import coords, free_port
from dapo_megatron.train.actor import Actor
from dapo_megatron.train.checkpoint import load_checkpoint, load_start, save_checkpoint
from dapo_megatron.train.logprobs import Rows, assemble
from dapo_megatron.train.parallel import init_parallel
from dapo_megatron.train.reference import Reference
from dapo_megatron.weights.export import write_hf_shards
from dapo_megatron.weights.sync import push, sender_roles
from dapo_megatron.weights.transport import TRANSPORTS


class TrainWorker:
    def __init__(self, cfg: DapoConfig, model_path: str, spec: ModelSpec, rank: int, world_size: int,
                 log_path: Optional[str] = None, data_plane: Optional[dataplane.Handle] = None):
        redirect_output(log_path)  # before Megatron and torch.distributed print anything
        self.cfg, self.model_path, self.spec, self.rank, self.world_size = cfg, model_path, spec, rank, world_size
        self.actor = self.ref = self.transport = None
        self.sync_plan = None  # what this rank sends per weight sync, fixed by the first one
        # This rank's rows of the current step (key -> fields), read from the data plane once and
        # kept from the log-prob passes to the update; dropped when the update is done.
        self.rows: dict = {}
        self.rows_partition = ""
        self.plane = dataplane.connect(data_plane) if data_plane is not None else None
        self.peaks: dict[str, float] = {}  # phase -> peak device memory (GiB) where the device reports it

    def pid(self) -> int:
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the process group (asked of rank 0 only)."""
        return ray.util.get_node_ip_address(), free_port("")

    @heap.start_up()  # Megatron's imports and the models, this process's to keep
    def setup(self, master: tuple[str, int], total_steps: int) -> dict:
        """Join the process group, initialise Megatron's parallel state, build the models."""
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.rank % self.cfg.trainer.n_gpus_per_node))
        device = get_device(self.cfg.trainer.device)
        device.setup_process(self.cfg.trainer.n_gpus_per_node)
        if self.cfg.trainer.deterministic:
            device.make_deterministic()
        info = init_parallel(self.cfg.actor.parallel, device, seed=self.cfg.trainer.seed,
                             timeout_s=self.cfg.trainer.dist_timeout_s)
        c = self.cfg
        self.transport = TRANSPORTS[c.rollout.sync.transport](device)
        start = c.model.load_checkpoint  # the weights to start from instead of model.path's
        self.actor = Actor(c.actor, self.model_path, spec=self.spec, n=c.rollout.n, total_steps=total_steps,
                           dtype=c.model.dtype, temperature=c.rollout.temperature, load_weights=not start,
                           deterministic=c.trainer.deterministic)
        if c.actor.use_kl_loss:
            self.ref = Reference(c.ref, self.model_path, spec=self.spec, dtype=c.model.dtype,
                                 temperature=c.rollout.temperature,
                                 max_tokens_per_microbatch=c.actor.max_tokens_per_microbatch)
        if start:  # (a resume, if any, loads the run's own checkpoint over it: driver/moments.Moments.resume)
            load_start(start, self.actor, self.ref)
        return vars(info)

    def _phase_end(self, phase: str) -> None:
        """A phase's end: its peak device memory recorded (where the device reports one), and the
        free pages inside glibc's heap handed back. Each phase frees buffers sized by the step's
        tokens, and their holes stayed resident: a rank of verl's fully-async script on the tiny
        assets grew every step until Ray killed it for host memory (bench/rank_memory.py)."""
        device = get_device(self.cfg.trainer.device)
        device.release_host_memory()
        peak = device.peak_memory_gb()
        if peak is not None:
            self.peaks[phase] = max(peak, self.peaks.get(phase, 0.0))

    def pop_memory(self) -> dict[str, float]:
        """Peak device memory per phase since the last call (empty on a CPU)."""
        out, self.peaks = self.peaks, {}
        return out

    def offload(self, what: list[str]) -> None:
        """The actor's `what` (params / grads / optimizer) to host memory: train/offload.py."""
        self._phase_end("before_offload")
        self.actor.offload(what)

    def onload(self, what: list[str]) -> None:
        self.actor.onload(what)
        self._phase_end("onload")

    def compute_logprobs(self, batch: RolloutBatch) -> Optional[Rows]:
        return self.actor.compute_logprobs(batch)

    def compute_ref_logprobs(self, batch: RolloutBatch) -> Optional[Rows]:
        return self.ref.compute_logprobs(batch)

    def update(self, batch: RolloutBatch) -> dict:
        return self.actor.update(batch)

    def step_logprobs(self, step: dataplane.StepBatch, model: str = "actor") -> Optional[dict]:
        """Log-probs of this DP rank's rows of the step (those it updates on) by `model` (actor: `old_logprobs`, and the
        recorded routes when the actor records them; ref: `ref_logprobs`), kept for this rank's
        update by every TP rank of the last stage (they hold the same values) and, under PP or
        CP, written to the data plane by TP rank 0 for the ranks that computed none. Returns, on the reporting ranks,
        the columns written and metrics: the rollout-vs-trainer gap over these rows (actor), with
        their token count."""
        c = coords()
        # The rows this rank trains on (its share of every mini-batch): it reads them once and
        # keeps their log-probs for its update. One mini-batch: split_for_dp's share, as always.
        minis = self.actor.minibatches(step.sequence_lengths, step.loss_tokens)
        rows = list(dict.fromkeys(r for share, _ in minis for r in share))
        batch = dataplane.read_batch(self.plane, step, rows, read_by(READ_BY_LOGPROBS), self._rows(step))
        part = (self.actor if model == "actor" else self.ref).compute_logprobs(batch, local=True)
        if part is None:
            return None
        values = assemble([part])  # this rank's rows, in `rows` order
        name = "old_logprobs" if model == "actor" else "ref_logprobs"
        lengths = batch.response_lengths.tolist()
        out_rows = [{name: values["logprobs"][i, :n]} for i, n in enumerate(lengths)]
        if "routed_experts" in values:
            for row, routes in zip(out_rows, unpad_positions(values["routed_experts"], batch.sequence_lengths)):
                row["routed_experts"] = routes
        keys = [step.keys[i] for i in rows]
        # Into the data plane only for the ranks of this DP share that got none (earlier pipeline
        # stages, other CP ranks): at PP 1 and CP 1 every rank keeps its own and nobody reads them.
        if not c.tp_rank and (c.pp > 1 or c.cp > 1):
            self.plane.put(step.partition, keys, out_rows, writer=name)
        for key, row in zip(keys, out_rows):  # this rank's update reads these here, not back
            self.rows.setdefault(key, {}).update(row)
        self._phase_end(f"{model}_logprobs")
        if c.tp_rank:
            return None
        metrics = dict(part.metrics)
        if model == "actor":
            gap = rollout_logprob_metrics(batch.rollout_logprobs, values["logprobs"], batch.loss_mask)
            metrics.update({k: float(v) for k, v in gap.items()})
        return {"fields": list(out_rows[0]) if out_rows else [name], "metrics": metrics,
                "tokens": int(batch.loss_mask.bool().sum())}

    def step_update(self, step: dataplane.StepBatch, first: bool = True) -> dict:
        """The DAPO update on this rank's rows of every mini-batch, read from the data plane.
        Its data_plane/bytes_* count what this rank read and wrote since the last update (the
        step's; a streamed mini-batch's). `first`: the step's first update (`Actor.update`)."""
        minis = self.actor.minibatches(step.sequence_lengths, step.loss_tokens)
        rows = sorted({r for share, _ in minis for r in share})
        local = {r: i for i, r in enumerate(rows)}
        batch = dataplane.read_batch(self.plane, step, rows, read_by(READ_BY_UPDATE), self._rows(step))
        self.rows = {}
        minis = [([local[r] for r in share], counts) for share, counts in minis]
        metrics = self.actor.update(batch, minis, tokens=sum(step.sequence_lengths), new_step=first)
        self._phase_end("update")
        return {**metrics, **self._plane_counters()}

    def _rows(self, step: dataplane.StepBatch) -> dict:
        """The row cache of `step` (a new step, or one after a failed step, starts empty: request
        ids, hence keys, repeat across steps)."""
        if self.rows_partition != step.partition:
            self.rows, self.rows_partition = {}, step.partition
        return self.rows

    def _plane_counters(self) -> dict:
        return {f"data_plane/{k}": float(v) for k, v in self.plane.pop_counters().items()}

    def sync_address(self) -> Optional[tuple[str, int]]:
        """Where this rank's weight-sync transport listens, or None when it needs no receivers
        (weights/transport.py; a rank that sends nothing, weights/sync.sender_roles, never does)."""
        return self.transport.listen(any(sender_roles()))

    def push_weights(self, engines: list, bucket_mb: int, checksums: bool,
                     address: Optional[tuple[str, int]] = None) -> tuple[dict, int, list[int]]:
        """Send the tensors this rank owns (weights/sync.py) into every engine through the
        transport; returns their checksums (with `checksums`), bytes and the engines that died
        in it (the transport's `Sender.dead`). A collective: every rank
        takes part in the TP / expert-TP gathers."""
        sender = self.transport.sender(engines, address)
        sums, self.sync_plan = push(self.actor.chunks, sender, bucket_mb << 20, self.sync_plan, checksums=checksums)
        sender.close()
        self._phase_end("sync")
        return sums, self.sync_plan.nbytes, sorted(sender.dead)

    def save_hf(self, out_dir: str, shard_mb: int = 2048) -> dict:
        """Write the current weights as HF safetensors shards (one writer per stage); returns
        the writer's weight map (empty on non-writers). For checks and exports, not the loop."""
        with self.actor.offloader.onloaded():
            return write_hf_shards(self.actor.chunks, out_dir, shard_mb << 20)

    def save(self, root: str, step: int, trainer_state: dict, keep: int) -> str:
        tokenizer = None
        if self.cfg.model.tokenizer_path:  # (the assets' module imports transformers: only when needed)
            from dapo_megatron.assets import resolve_asset_path
            tokenizer = resolve_asset_path(self.cfg.model.tokenizer_path)
        with self.actor.offloader.onloaded():  # colocated: saved between steps, while offloaded
            return save_checkpoint(self.actor, root, step, trainer_state, keep=keep,
                                   hf_files=(self.model_path, tokenizer))

    def load(self, path: str, load_optimizer: bool = True) -> dict:
        return load_checkpoint(self.actor, path, load_optimizer=load_optimizer)
