"""Tiny random-init HF checkpoints (Qwen2 dense, Qwen3 dense, Qwen3-MoE) built offline.

Sizes are chosen for vLLM's CPU attention, which only accepts some head sizes (32 is the
smallest), and for 2-way TP/EP splits in tests: 4 query heads, 2 KV heads, 4 experts.
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
