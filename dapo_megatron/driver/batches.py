"""The step's batches, asked of the rollout manager and taken from it, as methods of the `Trainer`
(driver/trainer.py, which takes them from `Batches`): sync asks for a step's batch when the step
starts; one_step_off / async ask trainer.batches_ahead steps ahead, and a streamed step
(trainer.stream_minibatches) takes its batch a mini-batch at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

import ray

from dapo_megatron import hooks, roles
from dapo_megatron.driver.metrics import staleness
from dapo_megatron.driver.recovery import wait_manager


@dataclass(frozen=True)
class Request:
    """A batch asked of the rollout manager: one future per part it is handed over in (one: the
    whole batch; trainer.stream_minibatches: a mini-batch each, the last with the whole batch) and
    the step it is for."""
    refs: tuple
    step: int

    @property
    def last(self):
        """The call that returns once the step's collection is done, with the whole batch."""
        return self.refs[-1]


class Batches:
    """Asking and taking over the Trainer's fields (cfg, ctx, step, syncs, pending,
    stale_responses) and its `timed` phases."""

    def take_part(self, request: Request, k: int) -> tuple:
        """Part `k` of the step's batch, and with the last part the rollout metrics and the whole
        batch. sync: generated now, with the last step's weights. one_step_off / async: asked
        trainer.batches_ahead steps ago, generated while earlier steps trained; the batches of the
        next steps are asked once the first part is in, before it trains."""
        ahead, streamed = self.cfg.trainer.batches_ahead, len(request.refs) > 1
        with hooks.at("driver.generate", step=request.step, ctx=self.ctx), \
                self.timed("trainer_wait" if ahead else "gen", [k] if streamed else ()):
            part, metrics, batch = wait_manager(self, request.refs[k])
        if k == 0:
            asked = self.pending[-1].step if self.pending else request.step
            for s in range(asked + 1, self._ask_until() + 1):
                self.pending.append(self._request(s))
        if batch is not None:
            metrics.update(staleness(batch.versions, self.syncs, ahead, self.cfg.trainer.stale_share))
            self.stale_responses += round(metrics["rollout/stale_share"] * len(batch))
            metrics["rollout/stale_responses_total"] = float(self.stale_responses)
        return part, metrics, batch

    def _ask_until(self) -> int:
        """The last step whose batch may be asked now: trainer.batches_ahead past this one; under
        trainer.deterministic not past the next save, so that the batch after a save is generated
        with the saved weights, as a resume from that save generates it (a save drains)."""
        t = self.cfg.trainer
        until = min(self.step + 1 + t.batches_ahead, self.ctx.total_steps)
        if t.deterministic and t.save_freq > 0:
            until = min(until, -(-(self.step + 1) // t.save_freq) * t.save_freq)
        return until

    def wait_before_push(self) -> None:
        """The batches asked ahead finished on the weights the engines hold; under
        trainer.deterministic with partial rollouts, until one waits for this push, each response
        at its segment's end or finished (the later ones start only after it)."""
        manager, segments = self.ctx.manager, self.cfg.trainer.carries_in_flight
        for request in self.pending:
            until = (lambda s=request.step: roles.get("rollout manager", manager.waiting_for_push.remote(s))) \
                if segments else None
            wait_manager(self, request.last, get=False, until=until)
            if segments and not ray.wait([request.last], timeout=0)[0]:
                return  # it waits for this push: the later ones start after it

    def _request(self, step: int) -> Request:
        """Every part of step `step`'s batch asked at once: the manager's calls run in order."""
        t, d = self.cfg.trainer, self.cfg.data
        parts = t.parts(d.train_batch_size, self.cfg.actor.ppo_mini_batch_size)
        return Request(tuple(self.ctx.manager.next_batch.remote(step, k, parts) for k in range(parts)), step)
