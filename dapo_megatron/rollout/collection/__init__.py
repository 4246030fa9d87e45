"""Collect one step's training groups: generate -> score -> dynamic sampling (the rollout
manager's work, rollout/manager.py), by one of three strategies behind `Collection`:

rounds.py  recipe rounds (filter_groups.mode=sync): whole rounds of gen_batch_size prompts.
stream.py  streaming early stop (filter_groups.mode=early_stop): prompts as capacity frees, the
           rest aborted once the batch is full, their prompts back in the stream.
carry.py   asynchronous carrying (trainer.mode=async, partial_rollout): what is in flight when the
           batch fills goes on into the next collections, within trainer.max_staleness. Under
           trainer.deterministic, waves instead, whose responses wait for each push at a
           segment's end (rollout/features.py's `Segments`).

Engines are Ray actor handles with the `rollout.Engine` methods, called with the step's
data-plane partition: they store each group's tokens there and return `StoredGroup`s (keys and
lengths). The scorer turns those into `algo.Group`s whose payload is a `ScoredGroup` (the reward
worker reads the responses from the data plane), so tests can swap the reward. Groups the filter
drops are cleared from the data plane at once, the surplus when the batch is taken; aborted
groups were never stored. `driver/bytes` counts what the collecting process (the manager: the
control plane) received from the engines. A new strategy is a module here and a row in `build`.
"""
from __future__ import annotations

from dapo_megatron.config.schema import DapoConfig
from dapo_megatron.rollout.collection.base import (Collected, Collection, ScoredGroup, ScoreFn, Source, Store,
                                                   groups_to_batch, received)
from dapo_megatron.rollout.collection.carry import Carrying, Staleness
from dapo_megatron.rollout.collection.rounds import Rounds
from dapo_megatron.rollout.collection.stream import EarlyStop, Stream

__all__ = ["Carrying", "Collected", "Collection", "EarlyStop", "Rounds", "ScoreFn", "ScoredGroup", "Source",
           "Staleness", "Store", "Stream", "build", "groups_to_batch", "received"]


def build(cfg: DapoConfig, source: Source) -> Collection:
    """The strategy the config asks for (its keys read here, once)."""
    if cfg.algorithm.filter_groups.mode != "early_stop":
        return Rounds(source)
    by_responses = cfg.rollout.admission == "responses"
    if cfg.trainer.carries_in_flight and not cfg.trainer.deterministic:  # deterministic: segments, in waves
        return Carrying(source, cfg.rollout.max_concurrent_per_engine, Staleness.from_config(cfg.trainer),
                        by_responses=by_responses)
    return EarlyStop(source, cfg.rollout.max_concurrent_per_engine, by_responses=by_responses,
                     in_order=cfg.trainer.deterministic)
