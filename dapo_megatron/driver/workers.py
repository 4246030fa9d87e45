"""The training ranks seen from the driver: `TrainGroup` fans each call out to every rank's
`TrainWorker` (train/worker.py, the rank's Ray actor): every rank must take part because the calls
are collectives. Only metrics come back from the loop's calls; the whole-batch calls
(`compute_logprobs`, `update`: tools and checks) join log-probs here (`logprobs.assemble`).
"""
from __future__ import annotations

import ray

from dapo_megatron import dataplane, roles
from dapo_megatron.train.logprobs import assemble
from dapo_megatron.weights.transport import TRANSPORTS

# How long a rank's failed call waits for word of a dead peer: its collective failed because a peer
# died, and Ray reports the death a moment later (then the error names the dead rank, not the symptom).
DEATH_GRACE_S = 5.0


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
            except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as exc:
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

    def step_update(self, step: dataplane.StepBatch, first: bool = True) -> dict:
        """The update's metrics (rank 0's, reduced over ranks) and the step's data-plane bytes
        per rank (read + written by the log-prob passes and the update: mean and max over ranks).
        `first`: the step's first (streamed: a later mini-batch's update is not a new step)."""
        results = self._all([w.step_update.remote(step, first) for w in self.workers])
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
