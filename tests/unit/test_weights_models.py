"""Pure checks of the HF config -> Megatron config mapping and of the parallel-degree validation."""
import pytest

from dapo_megatron.config.schema import ParallelConfig
from dapo_megatron.models import get_arch, rope_theta
from dapo_megatron.models.gpt import gpt_config_kwargs
from dapo_megatron.train.parallel import validate_parallel


def _cfg(kind, **kw):
    from dapo_megatron.assets.models import tiny_config
    return tiny_config(kind, 512, **kw)


def test_qwen3_moe_router_and_sizes():
    kw = gpt_config_kwargs(_cfg("qwen3_moe"), get_arch("qwen3_moe"))
    assert kw["num_moe_experts"] == 4 and kw["moe_router_topk"] == 2 and kw["moe_ffn_hidden_size"] == 128
    assert kw["moe_router_pre_softmax"] is False  # norm_topk_prob=True: softmax over the top-k
    assert kw["qk_layernorm"] and not kw["add_qkv_bias"] and kw["kv_channels"] == 32
    kw = gpt_config_kwargs(_cfg("qwen3_moe", norm_topk_prob=False), get_arch("qwen3_moe"))
    assert kw["moe_router_pre_softmax"] is True


def test_qwen2_bias_eps_rope():
    hf = _cfg("qwen2", rms_norm_eps=1e-5)
    kw = gpt_config_kwargs(hf, get_arch("qwen2"))
    assert kw["add_qkv_bias"] and not kw["qk_layernorm"] and "num_moe_experts" not in kw
    assert kw["layernorm_epsilon"] == 1e-5 and kw["num_query_groups"] == 2
    assert rope_theta(hf) == 10000.0


def test_unknown_model_type_names_it():
    with pytest.raises(ValueError, match="llama"):
        get_arch("llama")


@pytest.mark.parametrize("cfg,world,key", [
    (ParallelConfig(tp=3), 4, "actor.parallel.tp"),
    (ParallelConfig(ep=3), 4, "actor.parallel.ep"),
    (ParallelConfig(vpp=2), 2, "actor.parallel.vpp"),
    (ParallelConfig(tp=0), 2, "actor.parallel.tp"),
])
def test_parallel_validation_names_the_key(cfg, world, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate_parallel(cfg, world)


def test_parallel_validation_derives_dp():
    assert validate_parallel(ParallelConfig(tp=2, pp=2), 8) == 2
    assert validate_parallel(ParallelConfig(tp=2, ep=2), 2) == 1  # experts reuse the TP ranks
