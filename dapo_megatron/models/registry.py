"""HF architectures we can build, as data: one `Arch` row per HF `model_type`.

A row owns everything that differs between model families: the Megatron config and model
(`config_fn`, `build_fn`), how a micro-batch becomes the model's inputs (`inputs_fn`: token ids
and positions for a GPT; positions [3, B, S] and pixels for a vision-language model) and how the
model is called with them (`forward_fn`). The weight name tables live in `weights/name_map.py`,
keyed by the same model_type. A new family (Qwen3-VL) adds a row; the trainer does not change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Arch:
    model_type: str
    qkv_bias: bool  # Qwen2 / Qwen2.5 have q/k/v biases
    qk_layernorm: bool  # Qwen3: RMSNorm on q and k per head
    moe: bool  # routed experts in every layer (no shared expert)
    config_fn: Callable  # (spec, arch) -> dict of TransformerConfig kwargs
    build_fn: Callable  # (spec, arch, tf_config, use_te=...) -> list of model chunks
    inputs_fn: Callable  # (micro, device, spec) -> dict of model inputs
    forward_fn: Callable  # (model chunk, inputs) -> logits [b, S, V/TP] (last stage) or hidden states


def _registry() -> dict[str, Arch]:
    from dapo_megatron.models import gpt, qwen3_vl
    gpt_fns = dict(config_fn=gpt.gpt_config_kwargs, build_fn=gpt.build_gpt_chunks, inputs_fn=gpt.gpt_inputs,
                   forward_fn=gpt.gpt_forward)
    rows = [
        Arch("qwen2", qkv_bias=True, qk_layernorm=False, moe=False, **gpt_fns),
        Arch("qwen3", qkv_bias=False, qk_layernorm=True, moe=False, **gpt_fns),
        Arch("qwen3_moe", qkv_bias=False, qk_layernorm=True, moe=True, **gpt_fns),
        Arch("qwen3_vl_moe", qkv_bias=False, qk_layernorm=True, moe=True, config_fn=qwen3_vl.vl_config_kwargs,
             build_fn=qwen3_vl.build_vl_chunks, inputs_fn=qwen3_vl.vl_inputs, forward_fn=gpt.gpt_forward),
    ]
    return {a.model_type: a for a in rows}


def get_arch(model_type: str) -> Arch:
    archs = _registry()
    if model_type not in archs:
        raise ValueError(f"unsupported model_type {model_type!r} in the HF config.json; "
                         f"supported: {', '.join(sorted(archs))}")
    return archs[model_type]
