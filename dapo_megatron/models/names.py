"""Building blocks of the HF -> Megatron-Core weight name tables, as pure data.

Each row maps an HF name template to a Megatron one (`{}`: layer id, then expert id). A tuple
`(megatron_name, part)` says the HF tensor is one part of a fused Megatron tensor: q/k/v of
`linear_qkv`, gate/up of `linear_fc1`. Megatron names are those of the local (torch) layer spec.
A family's table (`Arch.names`, models/registry.py) is the union of the blocks it has;
`weights/name_map.py` reads it.
"""
from __future__ import annotations

BASE = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
    "model.layers.{}.input_layernorm.weight": "decoder.layers.{}.input_layernorm.weight",
    "model.layers.{}.self_attn.q_proj.weight": ("decoder.layers.{}.self_attention.linear_qkv.weight", "q"),
    "model.layers.{}.self_attn.k_proj.weight": ("decoder.layers.{}.self_attention.linear_qkv.weight", "k"),
    "model.layers.{}.self_attn.v_proj.weight": ("decoder.layers.{}.self_attention.linear_qkv.weight", "v"),
    "model.layers.{}.self_attn.o_proj.weight": "decoder.layers.{}.self_attention.linear_proj.weight",
    "model.layers.{}.post_attention_layernorm.weight": "decoder.layers.{}.pre_mlp_layernorm.weight",
}
QKV_BIAS = {
    "model.layers.{}.self_attn.q_proj.bias": ("decoder.layers.{}.self_attention.linear_qkv.bias", "q"),
    "model.layers.{}.self_attn.k_proj.bias": ("decoder.layers.{}.self_attention.linear_qkv.bias", "k"),
    "model.layers.{}.self_attn.v_proj.bias": ("decoder.layers.{}.self_attention.linear_qkv.bias", "v"),
}
QK_NORM = {
    "model.layers.{}.self_attn.q_norm.weight": "decoder.layers.{}.self_attention.q_layernorm.weight",
    "model.layers.{}.self_attn.k_norm.weight": "decoder.layers.{}.self_attention.k_layernorm.weight",
}
DENSE_MLP = {
    "model.layers.{}.mlp.gate_proj.weight": ("decoder.layers.{}.mlp.linear_fc1.weight", "gate"),
    "model.layers.{}.mlp.up_proj.weight": ("decoder.layers.{}.mlp.linear_fc1.weight", "up"),
    "model.layers.{}.mlp.down_proj.weight": "decoder.layers.{}.mlp.linear_fc2.weight",
}
MOE_MLP = {
    "model.layers.{}.mlp.gate.weight": "decoder.layers.{}.mlp.router.weight",
    "model.layers.{}.mlp.experts.{}.gate_proj.weight":
        ("decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.weight", "gate"),
    "model.layers.{}.mlp.experts.{}.up_proj.weight":
        ("decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.weight", "up"),
    "model.layers.{}.mlp.experts.{}.down_proj.weight":
        "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight",
}
TEXT_PREFIX = "model."  # a text model's HF prefix; lm_head sits outside it


def under(prefix: str, table: dict) -> dict:
    """A table's rows with HF names `model.X` renamed `<prefix>X` (values kept)."""
    return {(prefix + hf[len(TEXT_PREFIX):] if hf.startswith(TEXT_PREFIX) else hf): v for hf, v in table.items()}
