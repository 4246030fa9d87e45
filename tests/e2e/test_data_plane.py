"""The data plane (real TransferQueue on a local Ray): rows round-trip by key and field, the driver
handles the same bytes per response whatever the response length, a training rank reads only its
share, and dropped groups leave nothing behind.

The engine here is `FakeEngine`: the real `Engine` protocol (generate / submit / poll / abort) and
the real data-plane store of the engine actor, with random tokens of a chosen length instead of
vLLM, so response lengths of 1024 cost nothing. The real engine is in test_collect.py.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

pytestmark = pytest.mark.e2e

N = 4


class FakeEngine:
    """Fake (no vLLM): every response is `length` random tokens; group i finishes `delay * (i % 3)`
    seconds after submit, so early stop has requests in flight to abort."""

    def __init__(self, data_plane, length: int, delay: float = 0.0):
        from dapo_megatron.rollout.actor import GroupStore
        self.store, self.length, self.delay = GroupStore(data_plane, "fake"), length, delay
        self.live: dict = {}  # request id -> (due time, group)
        self.gen = torch.Generator().manual_seed(0)

    def _group(self, rid, prompt, sampling, index):
        from dapo_megatron.rollout.types import RolloutGroup
        responses = [torch.randint(3, 400, (self.length,), generator=self.gen).tolist() for _ in range(sampling.n)]
        return RolloutGroup(rid, index, list(prompt.ids), responses, [[-0.5] * self.length] * sampling.n,
                            ["length"] * sampling.n)

    def generate(self, prompts, sampling, partition=None):
        groups = [self._group(f"gen-{i}", p, sampling, i) for i, p in enumerate(prompts)]
        for g in groups:
            self.store.expect(g.request_id, partition)
        return self.store.put(groups)

    def submit(self, request_id, prompt, sampling, index=-1, partition=None):
        self.store.expect(request_id, partition)
        self.live[request_id] = (time.monotonic() + self.delay * (index % 3), self._group(request_id, prompt, sampling, index))

    def poll(self, timeout=0.0, max_groups=None):
        time.sleep(timeout)
        done = [rid for rid, (due, _) in self.live.items() if due <= time.monotonic()]
        return self.store.put([self.live.pop(rid)[1] for rid in done])

    def abort(self, request_ids):
        for rid in request_ids:
            if rid in self.live:
                group = self.live[rid][1]
                group.finish_reasons = ["abort"] * len(group.responses)
                self.live[rid] = (0.0, group)
        return list(request_ids)


@pytest.fixture(scope="module")
def plane_env(tiny_assets, tmp_path_factory, local_ray):
    from dapo_megatron import dataplane
    from dapo_megatron.config.schema import DapoConfig, DataPlaneConfig
    from dapo_megatron.rollout.reward_worker import RewardWorker
    # FakeEngine is defined here: Ray's workers import this module by name (the session's Ray has
    # tests/e2e on their path: tests/conftest.py)
    handle = dataplane.start(DataPlaneConfig())
    reward = RewardWorker(DapoConfig(), str(tiny_assets / "tokenizer"), handle)  # the manager's, in this process
    yield handle, dataplane.connect(handle), reward
    reward.close()
    dataplane.stop()


def _items(n, length=300):
    """Prompts of real length (hundreds of tokens)."""
    from dapo_megatron.batch import Prompt
    from dapo_megatron.data.dataset import PromptItem
    return [PromptItem(i, Prompt(tuple(range(5, 5 + length + i))), [], "7", "tiny_add", {}, f"row {i}")
            for i in range(n)]


class Items:
    """A dataset of `_items` for the collect functions."""

    def __init__(self, n):
        self.items = _items(n)

    def __getitem__(self, i):
        return self.items[i]

    def __len__(self):
        return len(self.items)


def test_rows_round_trip_by_key_and_field_and_clear_to_baseline(plane_env):
    _, plane, _ = plane_env
    baseline = plane.resident_bytes()
    rows = [dict(prompts=list(range(7 + i)), responses=list(range(3 * i + 1)), rollout_logprobs=[-0.25] * (3 * i + 1),
                 loss_mask=[1] * (3 * i + 1), routed_experts=torch.full((7 + i + 3 * i + 1, 2, 3), i, dtype=torch.int16),
                 scores=float(i), acc=bool(i % 2)) for i in range(3)]
    stored = plane.put("rt", ["a", "b", "c"], rows, writer="test")
    assert plane.resident_bytes() - baseline == stored
    got = plane.get("rt", ["c", "a"], ["responses", "routed_experts", "scores", "acc"])
    assert got[0]["responses"].tolist() == rows[2]["responses"] and got[1]["responses"].tolist() == [0]
    assert got[0]["routed_experts"].shape == (16, 2, 3) and got[0]["routed_experts"].dtype == torch.int16
    assert (got[0]["scores"], got[0]["acc"], got[1]["acc"]) == (2.0, False, False)
    plane.put("rt", ["b"], [{"old_logprobs": torch.tensor([-1.0, -2.0, -3.0, -4.0])}], writer="old_logprobs")
    assert plane.get("rt", ["b"], ["old_logprobs"])[0]["old_logprobs"].tolist() == [-1.0, -2.0, -3.0, -4.0]
    with pytest.raises(ValueError, match="finish_reasons"):
        plane.put("rt", ["a"], [{"finish_reasons": "stop"}], writer="test")
    plane.clear("rt")
    # the controller keeps nothing of a cleared partition (a step's partition each step grew it
    # ~44 kB a step), and its name can be used again
    assert plane.resident_bytes() == baseline and "rt" not in plane.partitions()
    plane.put("rt", ["b"], rows[1:2], writer="test")
    assert plane.get("rt", ["b"], ["scores"])[0]["scores"] == 1.0
    plane.clear("rt")
    plane.clear("never written")  # nothing to clear: no error
    assert plane.resident_bytes() == baseline and "rt" not in plane.partitions()


def _collect(plane_env, length, partition):
    from dapo_megatron.algo import DynamicSampler
    from dapo_megatron.data.sampler import PromptSampler
    from dapo_megatron.rollout.collection import Rounds, Source, Store, received
    from dapo_megatron.rollout.reward_worker import RewardScorer
    from dapo_megatron.rollout.types import Sampling
    ray = pytest.importorskip("ray")
    handle, plane, reward = plane_env
    engine = ray.remote(FakeEngine).options(num_cpus=0).remote(handle, length)
    scorer = RewardScorer(reward, "acc")
    data = Items(8)
    source = Source([engine], data, PromptSampler(len(data), shuffle=False, seed=0), DynamicSampler(4, 1, enable=False),
                    scorer, 4)
    result = Rounds(source).collect(1, Sampling(n=N, max_tokens=length), Store(partition, plane))
    return result, result.metrics["driver/bytes"] / result.metrics["sampling/scored_responses"], received(result)


def test_driver_bytes_per_response_do_not_grow_with_response_length(plane_env):
    """16 vs 1024 tokens per response: the collecting process receives the same bytes per response
    from the engines (keys, lengths); the tokens are in the data plane, the scores only in the
    metadata (nobody reads them from the plane, so the reward worker writes none there)."""
    _, plane, _ = plane_env
    short, per_short, held_short = _collect(plane_env, 16, "short")
    long, per_long, held_long = _collect(plane_env, 1024, "long")
    assert per_long <= per_short * 1.05 and per_long < 400, (per_short, per_long)
    # what the driver holds after collection (its dataset's prompts + metadata) does not grow either
    assert held_long <= held_short * 1.05, (held_short, held_long)
    keys = [k for g in long.groups for k in g.payload.rollout.keys]
    rows = plane.get("long", keys, ["responses"])
    assert all(len(r["responses"]) == 1024 for r in rows)
    assert all(s == -1.0 for g in long.groups for s in g.payload.scores.tolist())
    with pytest.raises(KeyError, match="scores"):
        plane.get("long", keys, ["scores"])
    assert plane.resident_bytes() > 4 * N * 1024 * 8  # the responses (int64) live in the data plane
    plane.clear("short")
    plane.clear("long")


def test_each_dp_rank_reads_only_its_share(plane_env):
    """A rank's reads (what `TrainWorker.step_logprobs` reads) are its rows' bytes, within 1.1x;
    the DP shares cover the batch once. TP / PP peers use the same split (their DP rank's)."""
    from dapo_megatron import dataplane
    from dapo_megatron.batch import FIELDS
    from dapo_megatron.rollout.collection import groups_to_batch
    from dapo_megatron.batch import READ_BY_LOGPROBS, read_by
    from dapo_megatron.train.microbatch import split_for_dp
    _, plane, _ = plane_env
    result, _, _ = _collect(plane_env, 64, "share")
    step = groups_to_batch(result.groups, "share")
    shares = split_for_dp(step.sequence_lengths, 2)
    assert sorted(shares[0] + shares[1]) == list(range(len(step))) and shares[0] and shares[1]
    whole = sum(sum(v.numel() * v.element_size() for v in r.values())
                for r in plane.get("share", step.keys, [f for f in read_by(READ_BY_LOGPROBS) if f in step.fields]))
    for rows in shares:
        plane.pop_counters()
        batch = dataplane.read_batch(plane, step, rows, read_by(READ_BY_LOGPROBS))
        assert len(batch) == len(rows) and batch.group.tolist() == [step.group[i] for i in rows]
        own = sum(len(batch.prompts[i]) * 8 + len(batch.responses[i]) * (8 + 4) for i in range(len(rows)))
        got = plane.pop_counters()["bytes_get"]
        assert own <= got <= 1.1 * own, (own, got)
        assert got < 0.7 * whole  # not the whole batch
        assert FIELDS["rollout_logprobs"].dtype == batch.rollout_logprobs.dtype
    plane.clear("share")


def test_early_stop_clears_aborted_and_filtered_groups_at_once(plane_env):
    """What remains in the partition after collection is exactly the kept batch's rows."""
    ray = pytest.importorskip("ray")
    from dapo_megatron.algo import DynamicSampler, Group
    from dapo_megatron.data.sampler import PromptSampler
    from dapo_megatron.rollout.collection import EarlyStop, ScoredGroup, Source, Store
    from dapo_megatron.rollout.reward_worker import RewardScorer
    from dapo_megatron.rollout.types import Sampling
    handle, plane, reward = plane_env
    engine = ray.remote(FakeEngine).options(num_cpus=0, max_concurrency=4).remote(handle, 32, delay=0.3)
    real = RewardScorer(reward, "acc")

    def scorer(items, groups):  # the reward worker scores (and reads the plane); odd prompts keep
        scored = real(items, groups)
        return [Group([float(it.index % 2 and j % 2) for j in range(N)], g.payload)
                for it, g in zip(items, scored)]

    data = Items(24)
    prompts = PromptSampler(len(data), shuffle=False, seed=0)
    baseline = plane.resident_bytes()
    source = Source([engine], data, prompts, DynamicSampler(3, 10), scorer, 6)
    result = EarlyStop(source, max_concurrent_per_engine=6 * N).collect(1, Sampling(n=N, max_tokens=32), Store("early", plane))
    assert len(result.groups) == 3 and all(isinstance(g.payload, ScoredGroup) for g in result.groups)
    assert result.metrics["sampling/aborted_groups"] >= 1 and result.metrics["sampling/filtered_tokens"] > 0
    kept = sorted(k for g in result.groups for k in g.payload.rollout.keys)
    assert sorted(plane._tq.kv_list("early").get("early", {})) == kept
    plane.clear("early")
    assert plane.resident_bytes() == baseline


class StoresThenDies(FakeEngine):
    """Fake (no vLLM): a FakeEngine (rows keyed "doomed/...") whose process exits in the poll that
    has just stored its first finished groups, before it answers: killed between put and reply."""

    def __init__(self, data_plane, length: int):
        from dapo_megatron.rollout.actor import GroupStore
        super().__init__(data_plane, length)
        self.store = GroupStore(data_plane, "doomed")

    def poll(self, timeout=0.0, max_groups=None):
        if super().poll(timeout, max_groups):
            os._exit(1)
        return []


def test_rows_an_engine_stored_before_it_died_unanswered_are_cleared(plane_env):
    """A killed engine's prompts are generated again elsewhere; the rows it stored at the poll it
    never answered are cleared with them: the partition holds the kept batch's rows alone."""
    ray = pytest.importorskip("ray")
    from dapo_megatron.algo import DynamicSampler, Group
    from dapo_megatron.data.sampler import PromptSampler
    from dapo_megatron.rollout.collection import EarlyStop, ScoredGroup, Source, Store
    from dapo_megatron.rollout.health import EngineHealth
    from dapo_megatron.rollout.types import Sampling
    handle, plane, _ = plane_env
    engines = [ray.remote(FakeEngine).options(num_cpus=0, max_concurrency=4).remote(handle, 32, delay=0.2),
               ray.remote(StoresThenDies).options(num_cpus=0, max_concurrency=4).remote(handle, 32)]
    health = EngineHealth(engines, max_restarts=1)

    def scorer(items, groups):
        return [Group([float(j % 2) for j in range(N)], ScoredGroup(it, g, torch.zeros(N), torch.zeros(N, dtype=torch.bool)))
                for it, g in zip(items, groups)]
    data = Items(16)
    source = Source(engines, data, PromptSampler(len(data), shuffle=False, seed=0), DynamicSampler(4, 10), scorer, 8, health)
    result = EarlyStop(source, max_concurrent_per_engine=4 * N).collect(1, Sampling(n=N, max_tokens=32), Store("orphans", plane))
    assert health.restarts == 1 and 1 in health.dead  # it did die, after its put
    kept = sorted(k for g in result.groups for k in g.payload.rollout.keys)
    assert len(kept) == 4 * N and all(k.startswith("fake/") for k in kept)
    assert sorted(plane.keys("orphans")) == kept
    plane.clear("orphans")


def test_scorer_gives_the_rows_extra_info_to_a_custom_reward(plane_env, tmp_path, tiny_assets):
    """verl's reward contract through the reward worker: the dataset row's extra_info reaches
    compute_score, and the scores come back per response (metadata: none in the data plane)."""
    from dapo_megatron.batch import Prompt
    from dapo_megatron.config.schema import DapoConfig, RewardConfig
    from dapo_megatron.data.dataset import PromptItem
    from dapo_megatron.dataplane import read_batch
    from dapo_megatron.rollout.collection import groups_to_batch
    from dapo_megatron.rollout.reward_worker import RewardScorer, RewardWorker
    from dapo_megatron.rollout.types import RolloutGroup
    handle, plane, _ = plane_env
    path = tmp_path / "r.py"
    path.write_text("def fn(data_source, solution_str, ground_truth, extra_info):\n"
                    "    return {'score': float(extra_info['weight']), 'acc': extra_info['weight'] > 1}\n")
    cfg = DapoConfig(reward=RewardConfig(custom_fn=f"{path}:fn"))
    reward = RewardWorker(cfg, str(tiny_assets / "tokenizer"), handle)
    items = [PromptItem(i, Prompt((1, 2)), [], "3", "tiny_add", {"weight": w}, f"row {i}")
             for i, w in enumerate((0.5, 2.0))]
    groups = [RolloutGroup(f"g{i}", i, [1, 2], [[5], [6, 7]], [[-0.1], [-0.2, -0.3]], ["stop", "length"],
                           loss_masks=[[1], [1, 0]]) for i in range(2)]
    stored = []
    for g in groups:
        keys = [f"{g.request_id}/{j}" for j in range(2)]
        plane.put("extra", keys, g.rows(), writer="rollout")
        stored.append(g.stored("extra", keys, tuple(g.rows()[0])))
    scored = RewardScorer(reward, "acc")(items, stored)
    assert [g.payload.scores.tolist() for g in scored] == [[0.5, 0.5], [2.0, 2.0]]
    assert [g.metric_values for g in scored] == [[0.0, 0.0], [1.0, 1.0]]
    step = groups_to_batch(scored, "extra")
    assert step.scores == [0.5, 0.5, 2.0, 2.0] and step.group == [0, 0, 1, 1] and step.loss_tokens == [1, 1] * 2
    with pytest.raises(KeyError, match="scores"):
        plane.get("extra", step.keys, ["scores"])
    batch = read_batch(plane, step, [1, 3], ["prompts", "responses", "rollout_logprobs", "loss_mask"])
    assert batch.loss_mask.tolist() == [[1, 0], [1, 0]]
    torch.testing.assert_close(batch.rollout_logprobs, torch.tensor([[-0.2, -0.3]] * 2))
    reward.close()
    plane.clear("extra")


def test_a_groups_pixels_are_stored_once_and_read_once_per_rank(plane_env):
    """A prompt's pixel rows go in once for its n responses (an image row the responses point to);
    a rank reads each image row once however many of its rows share it; a text prompt's rows get
    empty image fields; clearing a group's data keys clears its pixels too."""
    from dapo_megatron.algo import Group
    from dapo_megatron.dataplane import read_batch
    from dapo_megatron.rollout.collection import ScoredGroup, groups_to_batch
    from dapo_megatron.batch import READ_BY_LOGPROBS, read_by
    from dapo_megatron.rollout.actor import GroupStore
    from dapo_megatron.rollout.types import RolloutGroup
    handle, plane, _ = plane_env
    baseline = plane.resident_bytes()
    store = GroupStore(handle, "img")
    pixels = torch.randn(96, 384)  # two images: grids 1x4x8 and 1x8x8
    groups = [RolloutGroup(f"r{i}", i, list(range(200 + i)), [[7] * (5 + j) for j in range(N)],
                           [[-0.5] * (5 + j) for j in range(N)], ["stop"] * N) for i in range(2)]
    groups[0].pixel_values, groups[0].image_grid_thw = pixels, [[1, 4, 8], [1, 8, 8]]
    for g in groups:
        store.expect(g.request_id, "img")
    stored = store.put(groups)
    assert stored[0].image_key == "img/r0/images" and stored[1].image_key == ""
    assert stored[0].data_keys == stored[0].keys + ["img/r0/images"] and stored[1].data_keys == stored[1].keys
    resident = plane.resident_bytes() - baseline
    assert pixels.numel() * 4 < resident < 2 * pixels.numel() * 4  # once, not N times
    scored = [Group([0.0] * N, ScoredGroup(_items(1)[0], s, torch.zeros(N), torch.zeros(N, dtype=torch.bool)))
              for s in stored]
    step = groups_to_batch(scored, "img")
    assert step.image_keys == ["img/r0/images"] * N + [""] * N and "pixel_values" in step.fields
    plane.pop_counters()
    batch = read_batch(plane, step, [0, 2, 5, 7], read_by(READ_BY_LOGPROBS))
    assert plane.pop_counters()["bytes_get"] < pixels.numel() * 4 * 1.5  # the shared image row read once
    assert torch.equal(batch.pixel_values[0], pixels) and torch.equal(batch.pixel_values[1], pixels)
    assert batch.image_grid_thw[1].tolist() == [[1, 4, 8], [1, 8, 8]]
    assert batch.pixel_values[2].shape == (0, 384) and batch.image_grid_thw[3].shape == (0, 3)
    text_only = read_batch(plane, step, [4, 6], read_by(READ_BY_LOGPROBS))
    assert text_only.pixel_values is None  # no image row among them: no image fields at all
    plane.clear("img", [k for s in stored for k in s.data_keys])
    assert plane.resident_bytes() == baseline


class SeededEngine(FakeEngine):
    """Fake (no vLLM): a response's tokens depend on its prompt and the step's sampling seed only,
    as a seeded vLLM request's do, so a restarted producer regenerates the same step. With
    `finish_order` (dataset indices) each poll returns the one in-flight group that comes first in
    it (aborted ones among them): the test, not the clock, sets which requests finish first."""

    def __init__(self, data_plane, length: int, finish_order=None):
        super().__init__(data_plane, length)
        self.rank = {index: i for i, index in enumerate(finish_order or [])}

    def _group(self, rid, prompt, sampling, index):
        import zlib

        from dapo_megatron.rollout.types import RolloutGroup
        gen = torch.Generator().manual_seed(zlib.crc32(f"{sampling.seed}:{list(prompt.ids)[-1]}".encode()))
        lengths = [self.length - (index + j) % 5 for j in range(sampling.n)]
        responses = [torch.randint(3, 400, (n,), generator=gen).tolist() for n in lengths]
        return RolloutGroup(rid, index, list(prompt.ids), responses, [[-0.5] * n for n in lengths],
                            ["length"] * sampling.n)

    def poll(self, timeout=0.0, max_groups=None):
        if not self.rank:
            return super().poll(timeout, max_groups)
        time.sleep(0.01)
        if not self.live:
            return []
        rid = min(self.live, key=lambda r: self.rank.get(self.live[r][1].index, len(self.rank)))
        return self.store.put([self.live.pop(rid)[1]])


class ShardEngine(SeededEngine):
    """Fake (no vLLM): a SeededEngine whose rows have keys of its own (`prefix`); `dies`: its
    process exits in `generate`, as one killed -9 mid-validation."""

    def __init__(self, data_plane, prefix: str, dies: bool = False):
        from dapo_megatron.rollout.actor import GroupStore
        super().__init__(data_plane, 24)
        self.store, self.dies = GroupStore(data_plane, prefix), dies

    def generate(self, prompts, sampling, partition=None):
        if self.dies:
            os._exit(1)
        return super().generate(prompts, sampling, partition)


def test_validation_generates_a_dead_engines_shard_again_on_its_replacement(plane_env, tiny_assets):
    """rollout.max_engine_restarts in validation: one of two engines dies in its `generate`; the
    manager reports it with its shard, the driver's part (recovery.replace: here the test) hands a
    replacement over, the shard is generated again, whole, and val/* equal the next validation's,
    which nobody killed. With the restarts spent, a death is the run's RoleDied naming the key."""
    import dataclasses as dc

    ray = pytest.importorskip("ray")
    from dapo_megatron import roles
    from dapo_megatron.rollout.manager import manager_actor
    handle, _, _ = plane_env
    cfg = _manager_cfg("sync")
    cfg = dc.replace(cfg, rollout=dc.replace(cfg.rollout, max_engine_restarts=1))

    def engine(name: str, dies: bool = False):
        return ray.remote(ShardEngine).options(num_cpus=0).remote(handle, name, dies)

    def val(metrics: dict) -> dict:
        return {k: v for k, v in metrics.items() if k.startswith("val/")}
    manager = manager_actor().options(num_cpus=0).remote(cfg, [engine("e0"), engine("e1", dies=True)],
                                                         str(tiny_assets / "tokenizer"), handle, Items(24), Items(13), ())
    pending = manager.evaluate.remote(0)
    (death,) = ray.get(manager.engine_deaths.remote(60.0))
    assert (death.engine, death.in_flight) == (1, 6), death  # its whole shard: prompts 1, 3, ..., 11
    ray.get(manager.replace_engine.remote(1, engine("e1-restart1")))
    got = val(ray.get(pending))
    assert got == val(ray.get(manager.evaluate.remote(0))) and "val/acc" in got
    ray.get(manager.replace_engine.remote(1, engine("e1-restart2", dies=True)))
    with pytest.raises(roles.RoleDied, match=r"^the rollout engine died: .*rollout.max_engine_restarts=1: every"):
        roles.get("rollout manager", manager.evaluate.remote(0))
    ray.kill(manager)


def _manager_cfg(mode: str):
    import dataclasses as dc

    from dapo_megatron.config.schema import DapoConfig
    cfg = DapoConfig()
    fg = dc.replace(cfg.algorithm.filter_groups, enable=True, mode=mode, max_num_gen_batches=10)
    return dc.replace(cfg, data=dc.replace(cfg.data, train_batch_size=3, gen_batch_size=4, max_response_length=24),
                      rollout=dc.replace(cfg.rollout, n=N, max_concurrent_per_engine=4 * N, seed=5),
                      algorithm=dc.replace(cfg.algorithm, filter_groups=fg),
                      reward=dc.replace(cfg.reward, custom_fn=os.path.join(os.path.dirname(__file__), "parity_reward.py")
                                        + ":compute_score"))


def _inline_batches(cfg, engine, data, reward, plane, steps):
    """The driver's collection at the start of issue #33 (driver/loop.py's `generate` and
    `train_step`, before the rollout manager): the reference the manager must reproduce."""
    from dapo_megatron.algo import DynamicSampler
    from dapo_megatron.data.sampler import PromptSampler
    from dapo_megatron.rollout import collection
    from dapo_megatron.rollout.collection import Source, Store, groups_to_batch
    from dapo_megatron.rollout.reward_worker import RewardScorer
    from dapo_megatron.rollout.types import Sampling
    fg = cfg.algorithm.filter_groups
    prompts = PromptSampler(len(data), shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    sampler = DynamicSampler(cfg.data.train_batch_size, fg.max_num_gen_batches, fg.on_exhausted, fg.enable)
    scorer, out = RewardScorer(reward, fg.metric), []
    strategy = collection.build(cfg, Source(engine, data, prompts, sampler, scorer, cfg.data.gen_batch_size))
    for step in steps:
        sampling = Sampling.from_config(cfg.rollout, cfg.data.max_response_length, seed=cfg.rollout.seed + step - 1)
        store = Store(f"step{step}-{step}", plane)
        collected = strategy.collect(step, sampling, store)
        out.append((groups_to_batch(collected.groups, store.partition),
                    {**collected.metrics, **scorer.pop_metrics(), "data/prompts_consumed": float(prompts.consumed)}))
        store.clear()
    return out


def _same(got, want, resumed=False):
    """Batches equal field by field; metrics equal but for timings. A resumed producer counts its
    collections (the partitions' names) afresh."""
    (batch, metrics), (ref, ref_metrics) = got, want
    assert {**vars(batch), "partition": ref.partition if resumed else batch.partition} == vars(ref)
    drop = ("timing/", "reward/time")
    assert ({k: v for k, v in metrics.items() if not k.startswith(drop)}
            == {k: v for k, v in ref_metrics.items() if not k.startswith(drop)})


@pytest.mark.parametrize("mode", ["sync", "early_stop"])
def test_rollout_manager_reproduces_the_drivers_batches_and_resumes_exactly(plane_env, tiny_assets, mode):
    """The rollout manager (a Ray actor) hands out, for a fixed seed, the batches the driver's own
    collection made before the manager existed: same keys, lengths, scores, groups, metrics, with
    dynamic sampling dropping groups; in early-stop mode with a scripted finish order (prompts
    aborted and pushed back in between). A second manager loaded from the first's state after
    step 1 (a resumed run) produces the same steps 2 and 3. The first hands each batch out in three
    parts (trainer.stream_minibatches): in order, they are the batch."""
    ray = pytest.importorskip("ray")
    from dapo_megatron.rollout.manager import manager_actor
    from dapo_megatron.rollout.reward_worker import RewardWorker
    handle, plane, _ = plane_env
    cfg = _manager_cfg(mode)
    reward = RewardWorker(cfg, str(tiny_assets / "tokenizer"), handle)  # the reference collection's
    order = [(i * 7) % 24 for i in range(24)] if mode == "early_stop" else None

    def engine():
        return ray.remote(SeededEngine).options(num_cpus=0, max_concurrency=4).remote(handle, 24, order)

    def manager():
        return manager_actor().options(num_cpus=0).remote(cfg, [engine()], str(tiny_assets / "tokenizer"), handle,
                                                          Items(24), None, ())

    def batch(m, step, parts=1):
        """Every part at once, as the trainer asks them; the whole batch and its metrics."""
        outs = ray.get([m.next_batch.remote(step, k, parts) for k in range(parts)])
        _, metrics, whole = outs[-1]
        assert [k for part, _, _ in outs for k in part.keys] == whole.keys  # the parts, in order, are the batch
        plane.clear(whole.partition)  # the trainer's part
        return whole, metrics

    # both started at once: the resumed one's process start-up (~10 s here) overlaps the first's steps;
    # the first hands its batches out a group at a time (trainer.stream_minibatches)
    first, resumed = manager(), manager()
    got = [batch(first, 1, 3)]
    state = ray.get(first.state_dict.remote())
    got += [batch(first, 2, 3), batch(first, 3, 3)]
    # what a checkpoint saves while step 2's batch waits untrained (trainer.mode=one_step_off)
    assert ray.get(first.state_dict.remote(2)) == state
    ray.get(resumed.load_state_dict.remote(state))
    again = [batch(resumed, 2), batch(resumed, 3)]
    want = _inline_batches(cfg, [engine()], Items(24), reward, plane, [1, 2, 3])
    for g, w in zip(got, want):
        _same(g, w)
    for g, w in zip(again, want[1:]):
        _same(g, w, resumed=True)
    metrics = [m for _, m in got]
    assert all(len(b) == 3 * N for b, _ in got) and sum(m["sampling/filtered_tokens"] for m in metrics) > 0, metrics
    if mode == "early_stop":
        assert sum(m.get("sampling/aborted_groups", 0) for m in metrics) > 0, metrics
    assert got[1][0].keys != got[2][0].keys  # the steps differ: a manager stuck on one batch fails
    reward.close()
    for m in (first, resumed):
        ray.kill(m)


def test_a_new_fields_row_reaches_a_ranks_passes_with_no_other_edit(plane_env, monkeypatch):
    """One FIELDS row (a per-token weight the engine writes and the update reads): stored with the
    engine's rows, it is in the update's read list and in the rank's batch, read once per step
    through the rank's row cache; the log-prob pass does not read it."""
    from dapo_megatron import batch as schema
    from dapo_megatron.dataplane import StepBatch, read_batch
    _, plane, _ = plane_env
    monkeypatch.setitem(schema.FIELDS, "token_weight", schema.Field(
        "token_weight", schema.TOKEN, torch.float32, readers=(schema.READ_BY_UPDATE,)))
    keys = [f"w/{i}" for i in range(4)]
    rows = [dict(prompts=list(range(300 + i)), responses=list(range(i + 2)), rollout_logprobs=[-0.5] * (i + 2),
                 token_weight=[0.25 * (i + 1)] * (i + 2)) for i in range(4)]
    plane.put("new", keys, rows, writer="rollout")
    step = StepBatch("new", keys, [0, 0, 1, 1], [302 + 2 * i for i in range(4)], [i + 2 for i in range(4)],
                     [i + 2 for i in range(4)], [1.0, -1.0, 1.0, -1.0], [True, False, True, False],
                     ("prompts", "responses", "rollout_logprobs", "token_weight"), advantages=[0.5, -0.5, 0.5, -0.5])
    assert "token_weight" in schema.read_by(schema.READ_BY_UPDATE)
    assert "token_weight" not in schema.read_by(schema.READ_BY_LOGPROBS)
    cache: dict = {}
    plane.pop_counters()
    first = read_batch(plane, step, [1, 3], schema.read_by(schema.READ_BY_LOGPROBS), cache)
    assert first.token_weight is None and first.scores.tolist() == [-1.0, -1.0]
    logprob_pass = plane.pop_counters()["bytes_get"]
    update = read_batch(plane, step, [1, 3], schema.read_by(schema.READ_BY_UPDATE), cache)
    assert update.token_weight.tolist() == [[0.5, 0.5, 0.5, 0.0, 0.0], [1.0] * 5]
    assert update.advantages.tolist() == [-0.5, -0.5] and update.responses[1].tolist() == list(range(5))
    assert 0 < plane.pop_counters()["bytes_get"] <= 10 * 4 * 1.1 < logprob_pass  # only the new column
    plane.clear("new")


class LeanHost:
    """The lean layout's host (trainer.layout=lean: the rollout manager's part in it): the data
    plane started in this actor's own process, its addresses served to clients that attach."""

    def __init__(self, name: str, storage_units: int):
        from dapo_megatron import dataplane
        from dapo_megatron.config.schema import DataPlaneConfig
        self.handle = dataplane.start(DataPlaneConfig(storage_units=storage_units), host=name)

    def own_handle(self):
        return self.handle

    def data_plane_config(self):
        from dapo_megatron import dataplane
        return dataplane.hosted_config()

    def listening(self) -> set[int]:
        import psutil
        return {c.laddr.port for c in psutil.Process().net_connections() if c.status == psutil.CONN_LISTEN}

    def read(self, handle, keys):
        from dapo_megatron import dataplane
        return [r["responses"].tolist() for r in dataplane.connect(handle).get("lean", keys, ["responses"])]


class PlaneClient:
    def put(self, handle, keys, lengths):
        from dapo_megatron import dataplane
        return dataplane.connect(handle).put("lean", keys, [{"responses": list(range(n))} for n in lengths],
                                             writer="client")


def test_the_lean_layout_hosts_the_controller_and_storage_units_in_one_process(local_ray):
    """trainer.layout=lean: TransferQueue's controller and both storage units serve from the host's
    own process (their ports are its), no actor of TransferQueue's starts, and a client in another
    process reaches them through the host's name, rows intact."""
    import ray

    from dapo_megatron import dataplane
    def named() -> set[str]:
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    before = named()
    name = f"lean-host-{os.getpid()}"
    host = ray.remote(num_cpus=0)(LeanHost).options(name=name).remote(name, 2)
    try:
        handle = dataplane.Handle(host=name)
        assert ray.get(host.own_handle.remote()) == handle  # what start returns reaches it
        client = ray.remote(num_cpus=0)(PlaneClient).remote()
        assert ray.get(client.put.remote(handle, ["x", "y"], [3, 301])) > 0
        assert ray.get(host.read.remote(handle, ["y", "x"])) == [list(range(301)), [0, 1, 2]]
        conf = ray.get(host.data_plane_config.remote())
        units = conf.backend.SimpleStorage.zmq_info
        ports = {*conf.controller.zmq_info.ports.values(), *(p for u in units.values() for p in u.ports.values())}
        assert len(units) == 2 and ports <= ray.get(host.listening.remote()), (ports, units)
        assert named() - before == {name}
    finally:
        ray.kill(host)
