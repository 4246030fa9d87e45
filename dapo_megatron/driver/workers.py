"""Training ranks as Ray actors, and the group that calls them with explicit methods.

One `TrainWorker` per Megatron rank holds this rank's actor (and reference, when a KL term
needs it; it shares the actor's ranks and parallel state). `TrainGroup` fans each call out to
every rank: every rank must take part because the calls are collectives. In the loop
(`step_logprobs`, `step_update`) each rank reads the rows of its DP share from the data plane
and writes its log-probs back there by column; only metrics come back. The whole-batch calls
(`compute_logprobs`, `update`: tools and checks) join log-probs here (`logprobs.assemble`).
"""
from __future__ import annotations

import os
from typing import Optional

import ray

from dapo_megatron import dataplane, roles
from dapo_megatron.batch import READ_BY_LOGPROBS, READ_BY_UPDATE, RolloutBatch, read_by, unpad_positions
from dapo_megatron.config.schema import DapoConfig
from dapo_megatron.logs import redirect_output
from dapo_megatron.models import ModelSpec
from dapo_megatron.parallel import coords, free_port
from dapo_megatron.train.logprobs import Rows, assemble
from dapo_megatron.weights.transport import TRANSPORTS

# How long a rank's failed call waits for word of a dead peer: its collective failed because a peer
# died, and Ray reports the death a moment later (then the error names the dead rank, not the symptom).
DEATH_GRACE_S = 5.0


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

    def setup(self, master: tuple[str, int], total_steps: int) -> dict:
        """Join the process group, initialise Megatron's parallel state, build the models."""
        from dapo_megatron.device import get_device
        from dapo_megatron.train.actor import Actor
        from dapo_megatron.train.parallel import init_parallel
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.rank % self.cfg.trainer.n_gpus_per_node))
        device = get_device(self.cfg.trainer.device)
        device.setup_process(self.cfg.trainer.n_gpus_per_node)
        info = init_parallel(self.cfg.actor.parallel, device, seed=self.cfg.trainer.seed,
                             timeout_s=self.cfg.trainer.dist_timeout_s)
        c = self.cfg
        self.transport = TRANSPORTS[c.rollout.sync.transport](device)
        start = c.model.load_checkpoint  # the weights to start from instead of model.path's
        self.actor = Actor(c.actor, self.model_path, spec=self.spec, n=c.rollout.n, total_steps=total_steps,
                           dtype=c.model.dtype, temperature=c.rollout.temperature, load_weights=not start)
        if c.actor.use_kl_loss:
            from dapo_megatron.train.reference import Reference
            self.ref = Reference(c.ref, self.model_path, spec=self.spec, dtype=c.model.dtype,
                                 temperature=c.rollout.temperature,
                                 max_tokens_per_microbatch=c.actor.max_tokens_per_microbatch)
        if start:  # (a resume, if any, loads the run's own checkpoint over it: driver/trainer.Trainer.resume)
            from dapo_megatron.train.checkpoint import load_start
            load_start(start, self.actor, self.ref)
        return vars(info)

    def _peak(self, phase: str) -> None:
        from dapo_megatron.device import get_device
        peak = get_device(self.cfg.trainer.device).peak_memory_gb()
        if peak is not None:
            self.peaks[phase] = max(peak, self.peaks.get(phase, 0.0))

    def pop_memory(self) -> dict[str, float]:
        """Peak device memory per phase since the last call (empty on a CPU)."""
        out, self.peaks = self.peaks, {}
        return out

    def offload(self, what: list[str]) -> None:
        """The actor's `what` (params / grads / optimizer) to host memory: train/offload.py."""
        self._peak("before_offload")
        self.actor.offload(what)

    def onload(self, what: list[str]) -> None:
        self.actor.onload(what)
        self._peak("onload")

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
        from dapo_megatron.algo import rollout_logprob_metrics
        from dapo_megatron.train.logprobs import assemble
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
        self._peak(f"{model}_logprobs")
        if c.tp_rank:
            return None
        metrics = dict(part.metrics)
        if model == "actor":
            gap = rollout_logprob_metrics(batch.rollout_logprobs, values["logprobs"], batch.loss_mask)
            metrics.update({k: float(v) for k, v in gap.items()})
        return {"fields": list(out_rows[0]) if out_rows else [name], "metrics": metrics,
                "tokens": int(batch.loss_mask.bool().sum())}

    def step_update(self, step: dataplane.StepBatch) -> dict:
        """The DAPO update on this rank's rows of every mini-batch, read from the data plane.
        Its data_plane/bytes_* count what this rank read and wrote over the whole step."""
        minis = self.actor.minibatches(step.sequence_lengths, step.loss_tokens)
        rows = sorted({r for share, _ in minis for r in share})
        local = {r: i for i, r in enumerate(rows)}
        batch = dataplane.read_batch(self.plane, step, rows, read_by(READ_BY_UPDATE), self._rows(step))
        self.rows = {}
        minis = [([local[r] for r in share], counts) for share, counts in minis]
        metrics = self.actor.update(batch, minis, tokens=sum(step.sequence_lengths))
        self._peak("update")
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
        from dapo_megatron.weights.sync import sender_roles
        return self.transport.listen(any(sender_roles()))

    def push_weights(self, engines: list, bucket_mb: int, checksums: bool,
                     address: Optional[tuple[str, int]] = None) -> tuple[dict, int, list[int]]:
        """Send the tensors this rank owns (weights/sync.py) into every engine through the
        transport; returns their checksums (with `checksums`), bytes and the engines that died
        in it (the transport's `Sender.dead`). A collective: every rank
        takes part in the TP / expert-TP gathers."""
        from dapo_megatron.weights.sync import push
        sender = self.transport.sender(engines, address)
        sums, self.sync_plan = push(self.actor.chunks, sender, bucket_mb << 20, self.sync_plan, checksums=checksums)
        sender.close()
        self._peak("sync")
        return sums, self.sync_plan.nbytes, sorted(sender.dead)

    def save_hf(self, out_dir: str, shard_mb: int = 2048) -> dict:
        """Write the current weights as HF safetensors shards (one writer per stage); returns
        the writer's weight map (empty on non-writers). For checks and exports, not the loop."""
        from dapo_megatron.weights.export import write_hf_shards
        with self.actor.offloader.onloaded():
            return write_hf_shards(self.actor.chunks, out_dir, shard_mb << 20)

    def save(self, root: str, step: int, trainer_state: dict, keep: int) -> str:
        from dapo_megatron.train.checkpoint import save_checkpoint
        tokenizer = None
        if self.cfg.model.tokenizer_path:  # (the assets' module imports transformers: only when needed)
            from dapo_megatron.assets import resolve_asset_path
            tokenizer = resolve_asset_path(self.cfg.model.tokenizer_path)
        with self.actor.offloader.onloaded():  # colocated: saved between steps, while offloaded
            return save_checkpoint(self.actor, root, step, trainer_state, keep=keep,
                                   hf_files=(self.model_path, tokenizer))

    def load(self, path: str, load_optimizer: bool = True) -> dict:
        from dapo_megatron.train.checkpoint import load_checkpoint
        return load_checkpoint(self.actor, path, load_optimizer=load_optimizer)


class TrainGroup:
    """All ranks of the actor (+ reference); each method is one collective call on every rank."""

    def __init__(self, workers: list):
        self.workers = workers

    def _all(self, calls: list):
        """ray.get of one call per rank, naming a rank that died. Ray's get waits for the live
        ranks' calls first, and those may sit in a collective with the dead one until
        trainer.dist_timeout_s; or they fail first, a moment before Ray reports the death. The
        driver's watch is asked while they run (ranks reading a lost node's data plane)."""
        pending = list(calls)
        while pending:
            done = roles.wait(pending, 1)[:1]
            pending.remove(done[0])
            try:
                ray.get(done)
            except ray.exceptions.RayActorError as exc:
                raise self._died(calls.index(done[0]), exc) from None
            except ray.exceptions.RayTaskError as error:
                late, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_GRACE_S)
                for ref in late:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayActorError as exc:
                        raise self._died(calls.index(ref), exc) from None
                    except ray.exceptions.RayTaskError:
                        pass
                raise error
        return ray.get(calls)

    def _died(self, call: int, exc: Exception) -> roles.RoleDied:
        """RoleDied naming the rank of call `call`, its actor handle with it (`keep_roles`); the
        calls after one per rank are the engines' receives of a sync (`push_weights`)."""
        if call >= len(self.workers):
            return roles.died("rollout engine", exc)
        died = roles.died(f"training rank {call}", exc)
        died.rank = self.workers[call]
        return died

    def kill(self) -> None:
        """Every rank's process, at once (a rank whose peer died waits in a collective)."""
        for worker in self.workers:
            ray.kill(worker, no_restart=True)

    def setup(self, total_steps: int) -> dict:
        master = ray.get(self.workers[0].address.remote())
        return self._all([w.setup.remote(master, total_steps) for w in self.workers])[0]

    def offload(self, what: list[str]) -> None:
        self._all([w.offload.remote(what) for w in self.workers])

    def onload(self, what: list[str]) -> None:
        self._all([w.onload.remote(what) for w in self.workers])

    def pop_memory(self) -> dict:
        """memory/device_peak_gb/<phase>: the largest rank's peak in each phase since the last call."""
        out: dict[str, float] = {}
        for peaks in self._all([w.pop_memory.remote() for w in self.workers]):
            for phase, gb in peaks.items():
                key = f"memory/device_peak_gb/{phase}"
                out[key] = max(gb, out.get(key, 0.0))
        return out

    def compute_logprobs(self, batch_ref) -> tuple[dict, dict]:
        """({"logprobs": [B, T]} of the actor, joined from every DP rank's rows, plus
        "routed_experts" [B, S, layers, k] when the actor records routes; metrics)."""
        parts = self._all([w.compute_logprobs.remote(batch_ref) for w in self.workers])
        return assemble(parts), next(p.metrics for p in parts if p is not None)

    def compute_ref_logprobs(self, batch_ref):
        """[B, T] log-probs of the reference model."""
        return assemble(self._all([w.compute_ref_logprobs.remote(batch_ref) for w in self.workers]))["logprobs"]

    def update(self, batch_ref) -> dict:
        return self._all([w.update.remote(batch_ref) for w in self.workers])[0]

    def step_logprobs(self, step: dataplane.StepBatch, model: str = "actor") -> tuple[list[str], dict]:
        """Every rank's share of the step's log-probs by `model` goes into the data plane; returns
        the columns written and the metrics joined over the reporting ranks (max of maxima,
        token-weighted means)."""
        results = self._all([w.step_logprobs.remote(step, model) for w in self.workers])
        parts = [r for r in results if r is not None]
        metrics = _join_rank_metrics([p["metrics"] for p in parts], [p["tokens"] for p in parts])
        return parts[0]["fields"], metrics

    def step_update(self, step: dataplane.StepBatch) -> dict:
        """The update's metrics (rank 0's, reduced over ranks) and the step's data-plane bytes
        per rank (read + written by the log-prob passes and the update: mean and max over ranks)."""
        results = self._all([w.step_update.remote(step) for w in self.workers])
        return {**{k: v for k, v in results[0].items() if not k.startswith("data_plane/")}, **_plane_metrics(results)}

    def push_weights(self, engines: list, bucket_mb: int, checksums: bool,
                     transport: str = "object_store") -> tuple[dict, int]:
        """Every rank sends what it owns; returns all checksums, the bytes sent per engine and the
        engines (indices) that died in it, the others synced (object_store). The transport
        (rollout.sync.transport) says where ranks listen and which engine calls receive while the
        ranks push (weights/transport.py)."""
        addresses = self._all([w.sync_address.remote() for w in self.workers])
        receiving = TRANSPORTS[transport].start_receivers(engines, addresses)
        sums, nbytes, dead = {}, 0, set()
        pushes = [w.push_weights.remote(engines, bucket_mb, checksums, a) for w, a in zip(self.workers, addresses)]
        # One get over both sides: ray.get raises at the first failure, so an engine that dies
        # mid-receive stops the run now, not after its sender's collective times out.
        for part, n, lost in self._all(pushes + receiving)[:len(pushes)]:
            sums.update(part)
            nbytes += n
            dead.update(lost)
        return sums, nbytes, sorted(dead)

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


def _join_rank_metrics(parts: list[dict], tokens: list[int]) -> dict:
    """Metrics of the DP ranks' rows -> the batch's: `*_max` by max, `rollout/*` by token weight,
    the rest (the same on every rank, or already reduced) from the first."""
    total = max(sum(tokens), 1)
    out = dict(parts[0])
    for key in out:
        values = [p[key] for p in parts]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key.startswith("rollout/"):
            out[key] = sum(v * n for v, n in zip(values, tokens)) / total
    return out


def _plane_metrics(results: list) -> dict:
    """data_plane/bytes_get / bytes_put of one call: the mean over ranks and the largest rank's."""
    out = {}
    for key in ("data_plane/bytes_get", "data_plane/bytes_put"):
        values = [(r or {}).get(key, 0.0) for r in results]
        out[key] = sum(values) / len(values)
        out[f"{key}_max"] = max(values)
    return out
