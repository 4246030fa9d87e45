"""The run's supervisor: each attempt's roles started (or kept from the last one), its steps
taken (driver/trainer.py), and the run restarted when a role dies (trainer.max_restarts).

`run(cfg)` is what `python -m dapo_megatron.main` calls. Megatron's groups cannot take a new rank
in, so a restart starts every training rank again from the newest checkpoint; the engines, the
rollout manager and the data plane stay when only a training rank's process died
(`recovery.keep_roles`). SIGTERM asks the attempt to stop after its step and save.
"""
from __future__ import annotations

import dataclasses
import os
import signal
from typing import Optional

import ray

from dapo_megatron import roles
from dapo_megatron.config import DapoConfig
from dapo_megatron.driver import setup
from dapo_megatron.driver.colocate import TimeShare
from dapo_megatron.driver.metrics import MetricsLogger, PhaseLog, write_event
from dapo_megatron.driver.recovery import KEPT, Kept, RoleWatch, keep_roles
from dapo_megatron.driver.trainer import Trainer
from dapo_megatron.logs import LOGS


def run(cfg: DapoConfig) -> int:
    """The run; when a role dies, restarted in this process from its last checkpoint up to
    trainer.max_restarts times (Megatron's groups cannot take a new rank in: the training ranks
    all start again; the other roles too, unless `recovery.keep_roles` keeps them). Each restart
    is a line of <run dir>/events.jsonl."""
    limit, restarts, kept = cfg.trainer.max_restarts, 0, None
    while True:
        try:
            return attempt(cfg, kept, may_keep=restarts < limit)
        except roles.RoleDied as died:
            if restarts == limit and limit:
                raise roles.RoleDied(died.what, f"trainer.max_restarts={limit}") from None
            if restarts == limit:
                raise
            restarts += 1
            what, checkpoint = died.what, getattr(died, "checkpoint", None)
            kept = getattr(died, "kept", None)
            also = f"; {', '.join(KEPT)} kept" if kept else ""
            print(f"{what}: restart {restarts} of trainer.max_restarts={limit}, from {checkpoint or 'the start'}"
                  f"{also} (the dead role's output stays in {os.path.join(cfg.trainer.default_local_dir, LOGS)}/)",
                  flush=True)
            write_event(cfg.trainer.default_local_dir, "restart", what=what, step=getattr(died, "step", 0),
                        checkpoint=checkpoint, restart=restarts, kept=list(KEPT) if kept else [])
            if checkpoint:  # this run's own newest checkpoint, whatever resume_mode found at start
                cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume_mode=checkpoint))


def attempt(cfg: DapoConfig, kept: Optional[Kept] = None, may_keep: bool = False) -> int:
    """One attempt of the run: its roles started (or `kept` from the last attempt, new training
    ranks among them), then the loop. `may_keep`: a restart is left, so a dead training rank may
    leave the other roles up for it (`died.kept`); else every role goes with this Ray."""
    try:
        ctx = setup.restart_training(kept.ctx, cfg) if kept else setup.prepare(cfg)
    except (roles.RoleDied, roles.StartFailed):  # a role died starting: its placement group goes
        ray.shutdown()  # with this Ray, or the restart's would wait for devices it still holds
        raise
    setup.write_config(cfg, ctx.out_dir)
    logger = MetricsLogger(ctx.out_dir, cfg.trainer.logger, project=cfg.trainer.project_name,
                           experiment=cfg.trainer.experiment_name)
    run_ = Trainer(cfg, ctx, logger, TimeShare.from_config(cfg, ctx.train, ctx.engines), PhaseLog(ctx.out_dir))
    if kept:
        run_.deaths, run_.engine_restarts = kept.deaths, kept.engine_restarts
    signal.signal(signal.SIGTERM, lambda *_: setattr(run_, "stop_requested", True))
    roles.set_watch(RoleWatch(skip_engines=cfg.rollout.max_engine_restarts > 0))
    try:
        return run_.train()
    except roles.RoleDied as died:
        # what a restart resumes from; the roles left go with this Ray (a rank whose peer died waits
        # in a collective until dist_timeout_s: nothing of it can be saved), or stay for it
        died.checkpoint, died.step = run_.checkpoint, run_.step
        run_.phases.close()
        run_.logger.close()
        died.kept = keep_roles(run_, died) if may_keep else None
        if died.kept is None:
            ray.shutdown()
        raise
    except roles.StartFailed:  # nothing restarts: the roles go with this Ray
        run_.phases.close()
        run_.logger.close()
        ray.shutdown()
        raise
    finally:
        roles.set_watch(None)
