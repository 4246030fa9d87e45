"""The checkpoint and export check of `plan --build` (plan/coverage.py) on small, hand-made
reads and senders: a split that reads a row twice or leaves one out, a tensor read whole and in
parts, two ranks sending what one should, an engine sent a name twice, never, or at another
shape. The real 30B builds run it in test_plan_build.py."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dapo_megatron.plan.coverage import Coverage, MetaCheckpoint, _tiling


@pytest.mark.parametrize("reads,problem", [
    ({(0, 0, 3), (0, 3, 8)}, ""),  # two TP ranks' rows
    ({(0, 0, 4), (0, 0, 4), (0, 4, 8)}, ""),  # a data-parallel replica reads its range again: one set entry
    ({(None, 0, None)}, ""),  # a replicated tensor
    ({(0, 0, 5), (0, 3, 8)}, "rows 5-3 of dim 0 read twice"),
    ({(0, 0, 3), (0, 4, 8)}, "rows 3-4 of dim 0 never read"),
    ({(0, 0, 3), (0, 3, 6)}, "rows 6-8 of dim 0 never read"),
    ({(0, 2, 8)}, "rows 0-2 of dim 0 never read"),
    ({(None, 0, None), (1, 0, 2)}, "read whole and in parts [(1, 0, 2)]"),
    ({(0, 0, 8), (1, 0, 4)}, "split along dims [0, 1]"),
    (set(), "no parameter reads it"),
])
def test_reads_must_tile_a_tensor_exactly_once(reads, problem):
    assert _tiling(reads, (8, 4)) == problem


@pytest.fixture
def coverage(tmp_path):
    path = tmp_path / "tiny.tensors.json"
    path.write_text(json.dumps({"tensors": {"w.dense": [6, 4], "w.expert": [3, 5]}}))
    listed = MetaCheckpoint(path)
    assert listed.read("w.dense", 0, 2, 6).shape == (4, 4) and listed.reads == [("w.dense", 0, 2, 6)]
    with pytest.raises(Exception, match="w.missing is not in"):
        listed.shape("w.missing")
    cov = Coverage(listed, SimpleNamespace(model_type="qwen3_moe", num_experts=1), bucket_bytes=1 << 20)
    cov.reads.update({"w.dense": {(0, 0, 3), (0, 3, 6)}, "w.expert": {(None, 0, None)}})
    cov.roles(SimpleNamespace(pp_rank=0, ep_rank=0), dense=True, experts=False)
    cov.roles(SimpleNamespace(pp_rank=0, ep_rank=0), dense=False, experts=True)
    cov.sent = {("dense", 0): {"w.dense": (6, 4)}, ("experts", 0, 0): {"w.expert": (3, 5)}}
    return cov


def test_one_sender_per_key_each_name_once_is_clean(coverage):
    assert coverage.check() == []
    coverage.buckets = {k: 1 for k in coverage.sent}
    coverage.nbytes = {k: 48 for k in coverage.sent}
    assert "1 dense + 1 expert senders give each of 4 engines 2 tensors" in coverage.summary(4)


def test_two_dense_senders_of_one_stage_are_an_error(coverage):
    coverage.roles(SimpleNamespace(pp_rank=0, ep_rank=1), dense=True, experts=False)
    assert coverage.check() == ["('dense', 0) is sent by 2 ranks, not one"]


def test_a_sender_with_nothing_to_send_is_an_error(coverage):
    coverage.roles(SimpleNamespace(pp_rank=0, ep_rank=1), dense=False, experts=True)
    assert coverage.check() == ["('experts', 0, 1) has a sender that sends nothing"]


def test_an_engine_name_sent_twice_never_or_at_another_shape_is_an_error(coverage):
    coverage.sent[("experts", 0, 0)] = {"w.dense": (6, 4)}
    assert coverage.check() == ["engine: w.dense sent 2 times", "engine: w.expert is never sent"]
    coverage.sent[("experts", 0, 0)] = {"w.expert": (5, 3), "w.other": (1,)}
    assert coverage.check() == ["engine: w.expert sent as [5, 3], the list has [3, 5]",
                                "engine: w.other is sent but not in " + coverage.listed.dir]


def test_untiled_reads_and_load_errors_are_reported(coverage):
    coverage.reads["w.dense"] = {(0, 0, 4), (0, 3, 6)}
    coverage.errors.append("rank 3: load: unexpected tensor w.extra")
    assert coverage.check() == ["rank 3: load: unexpected tensor w.extra",
                                "w.dense [6, 4]: rows 4-3 of dim 0 read twice"]
