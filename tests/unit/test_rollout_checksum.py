"""Checksums both sides of a weight sync compute, and the engine's config checks (no vLLM)."""
import pytest
import torch

from dapo_megatron.config.schema import ParallelConfig, RolloutConfig
from dapo_megatron.rollout.checksum import Checksum, checksum_mismatches, state_dict_checksums, tensor_checksum
from dapo_megatron.rollout.engine import check_parallel
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


@pytest.mark.parametrize("kw,key", [(dict(tp=2, ep=4), "rollout.parallel.ep"), (dict(tp=0), "rollout.parallel.tp"),
                                    (dict(pp=2), "rollout.parallel.pp")])
def test_parallel_errors_name_the_key(kw, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        check_parallel(ParallelConfig(**kw))
    check_parallel(ParallelConfig(tp=2, ep=2))


def test_sampling_from_config():
    cfg = RolloutConfig(n=8, temperature=0.9, top_p=0.95)
    s = Sampling.from_config(cfg, max_tokens=100, seed=3)
    assert (s.n, s.temperature, s.top_p, s.max_tokens, s.seed) == (8, 0.9, 0.95, 100, 3)
    v = Sampling.validation(cfg, max_tokens=50)
    assert (v.n, v.temperature) == (cfg.val_kwargs.n, cfg.val_kwargs.temperature)
    assert RolloutGroup("r", 0, [1], [[2]], [[-0.1]], ["abort"]).aborted
