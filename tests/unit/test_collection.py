"""The collection strategy a config gets (rollout/collection/): built once from its keys, the
asynchronous knobs as one `Staleness` value, and the seed of each response from its prompt.
The strategies' collections themselves run on real engines in tests/e2e/test_collect.py."""
from __future__ import annotations

import dataclasses as dc

import pytest

from dapo_megatron.algo import DynamicSampler
from dapo_megatron.config.schema import DapoConfig
from dapo_megatron.rollout import collection
from dapo_megatron.rollout.collection import Carrying, EarlyStop, Rounds, Source, Staleness
from dapo_megatron.rollout.types import Sampling


def _cfg(filter_mode: str, **trainer) -> DapoConfig:
    cfg = DapoConfig()
    fg = dc.replace(cfg.algorithm.filter_groups, mode=filter_mode)
    return dc.replace(cfg, algorithm=dc.replace(cfg.algorithm, filter_groups=fg),
                      rollout=dc.replace(cfg.rollout, max_concurrent_per_engine=24),
                      trainer=dc.replace(cfg.trainer, **trainer))


@pytest.mark.parametrize("filter_mode,trainer,kind", [
    ("sync", {}, Rounds),
    ("early_stop", {}, EarlyStop),
    ("early_stop", {"mode": "one_step_off"}, EarlyStop),
    ("early_stop", {"mode": "async", "max_staleness": 3, "partial_rollout": False}, EarlyStop),
    ("early_stop", {"mode": "async", "max_staleness": 3}, Carrying),
])
def test_the_config_picks_its_strategy(filter_mode, trainer, kind):
    source = Source([], [], None, DynamicSampler(4, 2), lambda items, groups: [], 6)
    got = collection.build(_cfg(filter_mode, **trainer), source)
    assert type(got) is kind and got.source is source and got.in_flight() == []
    if kind is not Rounds:
        assert got.max_concurrent_per_engine == 24


def test_staleness_is_read_once_from_the_trainer_keys():
    """A group trained at step s (s - 1 pushes done) may hold tokens max_staleness pushes old; the
    groups of max_staleness - 1 more batches may be in flight beside this one's."""
    cfg = _cfg("early_stop", mode="async", max_staleness=3, stale_strategy="wait")
    s = Staleness.from_config(cfg.trainer)
    assert s == Staleness(3, wait=True)
    assert (s.oldest_version(1), s.oldest_version(5), s.batches_after) == (-3, 1, 2)
    assert Staleness.from_config(_cfg("early_stop", mode="async").trainer) == Staleness(1, wait=False)


def test_each_response_gets_a_seed_of_its_prompt():
    """Reproducible, different per response and per prompt (a shared seed + i made every prompt of
    a batch draw the same numbers); none without a seed."""
    sampling = Sampling(seed=7)
    seeds = {sampling.child_seed(prompt, i) for prompt in ([1, 2, 3], [1, 2, 4]) for i in range(3)}
    assert len(seeds) == 6 and sampling.child_seed([1, 2, 3], 1) == Sampling(seed=7).child_seed([1, 2, 3], 1)
    assert Sampling(seed=8).child_seed([1, 2, 3], 1) not in seeds and Sampling().child_seed([1], 0) is None
