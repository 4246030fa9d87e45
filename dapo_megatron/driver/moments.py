"""The run's moments that are not a step: start-up, resume, save and the end, as methods of the
`Trainer` (driver/trainer.py, which takes them from `Moments`). Each takes its turn with the
engines for the device (driver/colocate.py) in the order the memory plan sizes
(dapo_megatron.plan: start-up and resume hold the engines' share and the actor's whole state).
"""
from __future__ import annotations

import os
from typing import Optional

import ray

from dapo_megatron import hooks, roles
from dapo_megatron.driver.recovery import drop_pending
from dapo_megatron.driver.weight_sync import sync_weights
from dapo_megatron.roles import as_role
from dapo_megatron.train.checkpoint import resolve_resume
from dapo_megatron.weights.hf_io import CheckpointError


class Moments:
    """Start, resume, save and shutdown over the Trainer's fields (cfg, ctx, share, step, syncs,
    checkpoint, logger, phases, pending) and its `timed` / `in_sync` phases."""

    def start(self) -> None:
        """The attempt's first moments, in the turns a step takes with the device: the engines
        sleep, the ranks build (HF weights or model.load_checkpoint), a resume loads its
        checkpoint, the actor offloads around the sync that puts the loaded weights into the
        engines (also when sleeping at level 2 dropped theirs), and the engines wake."""
        self.share.before_build(self)
        with self.timed("build"):
            as_role("actor", self.ctx.train.setup, self.ctx.total_steps)
        resumed = self.resume()
        loaded = resumed or ("start" if self.cfg.model.load_checkpoint or self.share.drops_weights else None)
        self.share.start(self, (lambda: self._sync_loaded(loaded)) if loaded else None, resumed=bool(resumed))

    def resume(self) -> Optional[str]:
        """trainer.resume_mode: auto (latest checkpoint if any), disable, or a step folder. Returns
        "resume" when a checkpoint was loaded (new engines hold the HF weights, kept ones later
        ones: `start` syncs the checkpoint's in), else None."""
        path = resolve_resume(self.cfg.trainer.resume_mode, os.path.join(self.ctx.out_dir, "checkpoints"))
        if path is None:
            return None
        self.share.before_resume(self)
        try:
            with self.timed("resume"):
                state = as_role("actor", self.ctx.train.load, path)
        except CheckpointError as exc:  # raised in a training rank; Ray wraps it with its traceback
            raise CheckpointError(str(getattr(exc, "cause", None) or exc)) from None
        self.step, self.syncs, self.checkpoint = state["step"], state["syncs"], path
        self.stale_responses = state.get("stale_responses", 0)  # (not in checkpoints before 2026-12)
        roles.get("rollout manager", self.ctx.manager.load_state_dict.remote(state))
        moved = self.logger.rewind(self.step)
        later = f"; the metrics of {moved} later steps (their weights were not saved) moved to " \
                f"metrics.discarded.jsonl" if moved else ""
        print(f"resumed from {path} at step {self.step}{later}", flush=True)
        return "resume"

    def _sync_loaded(self, what: str) -> None:
        """The weights the ranks loaded (`what`: start or resume) into every engine, checksummed when
        rollout.sync.verify_every is on; the engines record the run's push count as their version."""
        with self.timed("sync", [what]), self.in_sync(what):
            sync_weights(self.ctx.train, self.ctx.engines, self.cfg.rollout.sync,
                         verify=self.cfg.rollout.sync.verify_every > 0, version=self.syncs)
        self.ctx.manager.pushed.remote(self.syncs)

    def state_dict(self) -> dict:
        """Counters, and the manager's prompt position and sampler state: a resume continues the stream."""
        before = self.pending[0].step if self.pending else None  # untrained batches' prompts go back
        return {"step": self.step, "syncs": self.syncs, "stale_responses": self.stale_responses,
                **roles.get("rollout manager", self.ctx.manager.state_dict.remote(before))}

    def save(self) -> None:
        with hooks.at("driver.save", step=self.step, ctx=self.ctx):  # a test's faults
            path = as_role("actor", self.ctx.train.save, os.path.join(self.ctx.out_dir, "checkpoints"), self.step,
                           self.state_dict(), self.cfg.trainer.max_checkpoints_to_keep)
        self.checkpoint = path
        self.logger.plot_soon()
        print(f"saved {path}", flush=True)

    def shutdown(self) -> None:
        """The batches asked ahead dropped, then the roles: the curves are drawn while they stop
        (plot() then draws only what that drawing missed: nothing, at the end of a run)."""
        drop_pending(self)
        self.phases.close()
        roles.get("rollout manager", self.ctx.manager.shutdown.remote())
        self.logger.plot()
        self.logger.close()
        ray.kill(self.ctx.manager)  # not in the placement group: removing it would leave the actor
        # Free the run's devices (its actors with them): a later run in the same process (a notebook,
        # a test session) finds Ray still up and would wait forever for a placement group of its own.
        self.ctx.placement.release()
