"""Pure checks of the model spec (HF config -> ModelSpec, flat or nested) and of the spec ->
Megatron config mapping."""
import pytest

from dapo_megatron.models import ModelSpec, get_arch
from dapo_megatron.models.gpt import gpt_config_kwargs
from dapo_megatron.weights import name_map

# Qwen3-30B-A3B's ratios scaled down, sizes that all differ: hidden 96, dense FFN 160, expert
# FFN 36 (not a multiple of 32), 6 query heads of 24 over 2 KV heads (head_dim != hidden / heads).
TEXT = dict(vocab_size=301, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-5, max_position_embeddings=512,
            num_experts=8, num_experts_per_tok=3, moe_intermediate_size=36,
            rope_parameters={"rope_type": "default", "rope_theta": 5e5})


def _cfg(kind, **kw):
    from dapo_megatron.assets.models import tiny_config
    return tiny_config(kind, 512, **kw)


def test_spec_from_a_flat_config():
    spec = ModelSpec.from_hf(dict(TEXT, model_type="qwen3_moe", norm_topk_prob=False, tie_word_embeddings=True))
    assert (spec.hidden_size, spec.ffn_hidden_size, spec.moe_ffn_hidden_size) == (96, 160, 36)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.num_layers) == (6, 2, 24, 3)
    assert (spec.num_experts, spec.moe_top_k, spec.norm_topk_prob) == (8, 3, False)
    assert spec.rope_theta == 5e5 and spec.tie_word_embeddings and spec.arch.moe
    assert spec.dims == dict(vocab=301, hidden=96, head_dim=24, q_dim=144, kv_dim=48, ffn=160, experts=8, moe_ffn=36)


def test_spec_from_a_nested_text_config():
    """A vision-language config keeps the language model under text_config; the text's tie flag
    wins (engines read that one) and a missing norm_topk_prob means renormalised top-k."""
    nested = dict(model_type="qwen3_vl_moe", tie_word_embeddings=True, vision_config={"depth": 2},
                  text_config=dict(TEXT, tie_word_embeddings=False))
    spec = ModelSpec.from_hf(nested)
    flat = ModelSpec.from_hf(dict(TEXT, model_type="qwen3_vl_moe"))
    assert spec == flat and spec.model_type == "qwen3_vl_moe"
    assert not spec.tie_word_embeddings and spec.norm_topk_prob
    assert spec.arch.model_type == "qwen3_vl_moe" and spec.arch.moe  # models/qwen3_vl.py


def test_spec_from_a_transformers_config_matches_its_dict():
    hf = _cfg("qwen3_moe")
    assert ModelSpec.from_hf(hf) == ModelSpec.from_hf(hf.to_dict())
    assert ModelSpec.from_hf(_cfg("qwen2")).head_dim == 32  # hidden / heads when head_dim is absent


@pytest.mark.parametrize("broken,words", [
    (dict(TEXT), "model_type"),
    ({k: v for k, v in TEXT.items() if k != "num_hidden_layers"} | {"model_type": "qwen3"}, "num_hidden_layers"),
    (dict(TEXT, model_type="qwen3_moe", decoder_sparse_step=2), "dense layers"),
])
def test_spec_errors_name_what_is_wrong(broken, words):
    with pytest.raises(ValueError, match=words):
        ModelSpec.from_hf(broken)


def test_expected_shapes_come_from_the_spec():
    spec = ModelSpec.from_hf(dict(TEXT, model_type="qwen3_moe"))
    shapes = name_map.expected_hf_shapes(spec)
    assert shapes["model.layers.2.self_attn.k_proj.weight"] == (48, 96)
    assert shapes["model.layers.0.mlp.experts.7.down_proj.weight"] == (96, 36)
    assert shapes["lm_head.weight"] == (301, 96) and len(shapes) == 3 + 3 * (2 + 4 + 2 + 1 + 8 * 3)  # norms, attention, qk-norms, router, experts
    tied = ModelSpec.from_hf(dict(TEXT, model_type="qwen3_moe", tie_word_embeddings=True))
    assert "lm_head.weight" not in name_map.expected_hf_shapes(tied)


def test_qwen3_moe_router_and_sizes():
    kw = gpt_config_kwargs(ModelSpec.from_hf(dict(TEXT, model_type="qwen3_moe")), get_arch("qwen3_moe"))
    assert kw["num_moe_experts"] == 8 and kw["moe_router_topk"] == 3 and kw["moe_ffn_hidden_size"] == 36
    assert kw["ffn_hidden_size"] == 160 and kw["kv_channels"] == 24 and kw["num_query_groups"] == 2
    assert kw["moe_router_pre_softmax"] is False  # norm_topk_prob=True: softmax over the top-k
    assert kw["qk_layernorm"] and not kw["add_qkv_bias"]
    kw = gpt_config_kwargs(ModelSpec.from_hf(_cfg("qwen3_moe", norm_topk_prob=False)), get_arch("qwen3_moe"))
    assert kw["moe_router_pre_softmax"] is True


def test_qwen2_bias_eps_rope():
    spec = ModelSpec.from_hf(_cfg("qwen2", rms_norm_eps=1e-5))
    kw = gpt_config_kwargs(spec, get_arch("qwen2"))
    assert kw["add_qkv_bias"] and not kw["qk_layernorm"] and "num_moe_experts" not in kw
    assert kw["layernorm_epsilon"] == 1e-5 and kw["num_query_groups"] == 2
    assert spec.rope_theta == 10000.0 and spec.rope_type == "default"


def test_unknown_model_type_names_it():
    with pytest.raises(ValueError, match="llama"):
        get_arch("llama")


def test_a_pickled_spec_carries_its_config_as_a_dict():
    """What a training rank receives: the same spec, its vision config readable, and unpickling it
    imports no transformers (a config object would: ~2 s of a core in every rank at every start)."""
    import pickle
    import subprocess
    import sys

    from transformers import Qwen3VLMoeConfig

    from dapo_megatron.assets.models import TINY_VL_MOE
    spec = ModelSpec.from_hf(Qwen3VLMoeConfig(**TINY_VL_MOE))
    sent = pickle.dumps(spec)
    got = pickle.loads(sent)
    assert got == spec and isinstance(got.hf, dict) and not isinstance(spec.hf, dict)
    assert got.vision_config == spec.vision_config and got.deepstack_layers == spec.deepstack_layers > 0
    probe = ("import pickle, sys; spec = pickle.loads(sys.stdin.buffer.read()); "
             "print(spec.model_type, spec.is_vision_language, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], input=sent, capture_output=True, check=True, timeout=120)
    assert out.stdout.decode().split() == ["qwen3_vl_moe", "True", "False"], out.stderr[-2000:]
