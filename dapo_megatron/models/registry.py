"""HF architectures we can build, as data: one `Arch` row per HF `model_type`.

A new architecture (Qwen3-VL: a language model plus a vision tower) adds a row with its own
`config_fn` / `build_fn`; the GPT-style rows share `gpt.py`. The weight name tables live in
`weights/name_map.py`, keyed by the same model_type.
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
    config_fn: Callable  # (hf_config, arch) -> dict of TransformerConfig kwargs
    build_fn: Callable  # (hf_config, arch, tf_config, ...) -> list of model chunks


def _registry() -> dict[str, Arch]:
    from dapo_megatron.models import gpt
    rows = [
        Arch("qwen2", qkv_bias=True, qk_layernorm=False, moe=False, config_fn=gpt.gpt_config_kwargs,
             build_fn=gpt.build_gpt_chunks),
        Arch("qwen3", qkv_bias=False, qk_layernorm=True, moe=False, config_fn=gpt.gpt_config_kwargs,
             build_fn=gpt.build_gpt_chunks),
        Arch("qwen3_moe", qkv_bias=False, qk_layernorm=True, moe=True, config_fn=gpt.gpt_config_kwargs,
             build_fn=gpt.build_gpt_chunks),
    ]
    return {a.model_type: a for a in rows}


def get_arch(model_type: str) -> Arch:
    archs = _registry()
    if model_type not in archs:
        raise ValueError(f"unsupported model_type {model_type!r} in the HF config.json; "
                         f"supported: {', '.join(sorted(archs))}")
    return archs[model_type]
