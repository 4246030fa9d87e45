"""HF architectures we can build, as data: one `Arch` row per HF `model_type`.

A row owns everything that differs between model families: the Megatron config and model
(`config_fn`, `build_fn`), how a micro-batch becomes the model's inputs (`inputs_fn`: token ids
and positions for a GPT; positions [3, B, S] and pixels for a vision-language model), how the
model is called with them (`forward_fn`), and its weight names: `names` (HF -> Megatron, built
from the blocks of `models/names.py`), the HF prefix of the language model (`language_prefix`),
modules copied as-is (`verbatim`) and expert tensors the files fuse (`fused_experts`);
`weights/name_map.py` reads them. A new family (Qwen3-VL) adds a row; the trainer and the
weight code do not change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Callable

from dapo_megatron.models import gpt, qwen3_vl
from dapo_megatron.models.names import BASE, DENSE_MLP, MOE_MLP, QK_NORM, QKV_BIAS, TEXT_PREFIX, under


@dataclass(frozen=True)
class Arch:
    """One family. Its tables (dicts) are left out of == and hash, which model_type decides."""
    model_type: str
    qkv_bias: bool  # Qwen2 / Qwen2.5 have q/k/v biases
    qk_layernorm: bool  # Qwen3: RMSNorm on q and k per head
    moe: bool  # routed experts in every layer (no shared expert)
    config_fn: Callable  # (spec, arch) -> dict of TransformerConfig kwargs
    build_fn: Callable  # (spec, arch, tf_config, use_te=...) -> list of model chunks
    inputs_fn: Callable  # (micro, device, spec) -> dict of model inputs
    forward_fn: Callable  # (model chunk, inputs) -> logits [b, S, V/TP] (last stage) or hidden states
    # HF name template -> Megatron template, or (fused Megatron template, part); see models/names.py.
    # The HF names are those of the per-expert tensors the weight sync sends and vLLM loads.
    names: dict = field(compare=False)
    # HF prefix of the language model's `model.` names (lm_head stays at the top).
    language_prefix: str = TEXT_PREFIX
    # Megatron prefix -> HF prefix of modules whose parameters keep their HF names and layout
    # below it, replicated over TP (not split).
    verbatim: dict = field(default_factory=dict, compare=False)
    # HF file tensor holding one layer's experts -> the per-expert tensors (HF names' last part
    # before `.weight`) it stacks, concatenated along their rows. {}: the files hold them apart.
    fused_experts: dict = field(default_factory=dict, compare=False)


_VL_LANGUAGE = "model.language_model."


@cache
def archs() -> dict[str, Arch]:
    """Every row, by model_type."""
    gpt_fns = dict(config_fn=gpt.gpt_config_kwargs, build_fn=gpt.build_gpt_chunks, inputs_fn=gpt.gpt_inputs,
                   forward_fn=gpt.gpt_forward)
    rows = [
        Arch("qwen2", qkv_bias=True, qk_layernorm=False, moe=False, **gpt_fns,
             names={**BASE, **QKV_BIAS, **DENSE_MLP}),
        Arch("qwen3", qkv_bias=False, qk_layernorm=True, moe=False, **gpt_fns,
             names={**BASE, **QK_NORM, **DENSE_MLP}),
        Arch("qwen3_moe", qkv_bias=False, qk_layernorm=True, moe=True, **gpt_fns,
             names={**BASE, **QK_NORM, **MOE_MLP}),
        # The text model under `model.language_model.`; the vision tower (first pipeline stage)
        # copied as-is. The official checkpoints, and vLLM (`is_fused_checkpoint_transposed`),
        # hold the experts fused and transposed: gate_up_proj [E, H, 2I], down_proj [E, I, H];
        # transformers 5.19's save_pretrained writes them untransposed ([E, 2I, H], [E, H, I]).
        # Both load (told apart by shape, `weights/reshape.fused_experts_layout`); we write the
        # official one.
        Arch("qwen3_vl_moe", qkv_bias=False, qk_layernorm=True, moe=True, config_fn=qwen3_vl.vl_config_kwargs,
             build_fn=qwen3_vl.build_vl_chunks, inputs_fn=qwen3_vl.vl_inputs, forward_fn=gpt.gpt_forward,
             names=under(_VL_LANGUAGE, {**BASE, **QK_NORM, **MOE_MLP}), language_prefix=_VL_LANGUAGE,
             verbatim={"visual.": "model.visual."},
             fused_experts={_VL_LANGUAGE + "layers.{}.mlp.experts.gate_up_proj": ("gate_proj", "up_proj"),
                            _VL_LANGUAGE + "layers.{}.mlp.experts.down_proj": ("down_proj",)}),
    ]
    return {a.model_type: a for a in rows}


def get_arch(model_type: str) -> Arch:
    if model_type not in archs():
        raise ValueError(f"unsupported model_type {model_type!r} in the HF config.json; "
                         f"supported: {', '.join(sorted(archs()))}")
    return archs()[model_type]
