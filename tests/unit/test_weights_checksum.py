"""Checksums both sides of a weight sync compute, and the engine's request types (no vLLM)."""
import pytest
import torch

from dapo_megatron.config.schema import RolloutConfig
from dapo_megatron.weights.checksum import (Checksum, checksum_mismatches, merge_checksums, shard_checksum,
                                            state_dict_checksums, tensor_checksum)
from dapo_megatron.rollout.types import RolloutGroup, Sampling


def test_checksum_is_order_sensitive_and_dtype_exact():
    t = torch.randn(64, 32)
    a = tensor_checksum(t)
    assert a == tensor_checksum(t.clone()) and a.numel == t.numel()
    assert abs(a.sum - tensor_checksum(t.t().contiguous()).sum) < 1e-9  # same values...
    assert a.weighted != tensor_checksum(t.t().contiguous()).weighted  # ...other layout
    swapped = torch.cat([t[32:], t[:32]])
    assert checksum_mismatches({"w": a}, {"w": tensor_checksum(swapped)}) == ["w"]


def test_chunked_sum_matches_one_pass():
    t = torch.randn((1 << 22) + 123, dtype=torch.float64)  # spans two chunks
    c = tensor_checksum(t)
    assert c.sum == pytest.approx(t.sum().item(), rel=1e-12)


@pytest.mark.parametrize("shape,dim,cuts", [((10, 6), 0, (3, 7)), ((10, 6), 1, (2,)), ((4, 5, 7), 2, (1, 4)),
                                             ((4, 5, 7), 1, (3,)), ((9,), 0, (4,))])
def test_shard_partials_add_up_to_the_full_checksum(shape, dim, cuts):
    """A TP-sharded engine's workers each checksum their slice; the merged partials must equal
    the trainer's checksum of the full tensor, and slices put back at the wrong offsets must not."""
    t = torch.randn(shape, dtype=torch.float64)
    bounds = [0, *cuts, shape[dim]]
    slices = [(t.narrow(dim, a, b - a), a) for a, b in zip(bounds, bounds[1:])]
    full = {"w": tensor_checksum(t)}
    parts = [{"w": shard_checksum(s, shape, dim, a)} for s, a in slices]
    assert checksum_mismatches(full, merge_checksums(parts)) == []
    wrong = [{"w": shard_checksum(slices[0][0], shape, dim, 0)}] * 2 + parts[2:]  # slice 0 twice, slice 1 lost
    assert checksum_mismatches(full, merge_checksums(wrong)) == ["w"]
    assert checksum_mismatches(full, merge_checksums(parts[:-1])) == ["w"]  # a missing slice


def test_shard_checksum_sees_slices_at_swapped_offsets():
    t = torch.randn(8, 4, dtype=torch.float64)
    swapped = [{"w": shard_checksum(t[:4], t.shape, 0, 4)}, {"w": shard_checksum(t[4:], t.shape, 0, 0)}]
    assert checksum_mismatches({"w": tensor_checksum(t)}, merge_checksums(swapped)) == ["w"]


def test_shard_checksum_spans_index_blocks():
    t = torch.randn(70000, 3, dtype=torch.float64)  # more rows than one index block holds
    parts = [{"w": shard_checksum(t[:, :2], t.shape, 1, 0)}, {"w": shard_checksum(t[:, 2:], t.shape, 1, 2)}]
    assert checksum_mismatches({"w": tensor_checksum(t)}, merge_checksums(parts)) == []


def test_mismatches_report_changed_missing_and_extra_names():
    sd = {"a": torch.ones(3), "b": torch.arange(4.0)}
    ref = state_dict_checksums(sd.items())
    assert checksum_mismatches(ref, dict(ref)) == []
    changed = dict(sd, b=torch.arange(4.0) + 1e-3)
    assert checksum_mismatches(ref, state_dict_checksums(changed.items())) == ["b"]
    assert checksum_mismatches(ref, {"a": ref["a"], "c": ref["b"]}) == ["b", "c"]
    # checksums that went through Ray / JSON as plain tuples compare the same
    assert checksum_mismatches(ref, {k: tuple(v) for k, v in ref.items()}) == []
    assert isinstance(ref["a"], Checksum)


def test_sampling_from_config():
    cfg = RolloutConfig(n=8, temperature=0.9, top_p=0.95)
    s = Sampling.from_config(cfg, max_tokens=100, seed=3)
    assert (s.n, s.temperature, s.top_p, s.max_tokens, s.seed) == (8, 0.9, 0.95, 100, 3)
    v = Sampling.validation(cfg, max_tokens=50)
    assert (v.n, v.temperature) == (cfg.val_kwargs.n, cfg.val_kwargs.temperature)
    assert RolloutGroup("r", 0, [1], [[2]], [[-0.1]], ["abort"]).aborted
