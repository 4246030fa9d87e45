"""HF <-> Megatron-Core parameter names: the code around each family's tables.

A family's tables are columns of its `Arch` row (models/registry.py, blocks in models/names.py):
`names` maps an HF name template to a Megatron one (`{}`: layer id, then expert id), a tuple
`(megatron_name, part)` saying the HF tensor is one part of a fused Megatron tensor: q/k/v of
`linear_qkv`, gate/up of `linear_fc1`; `reshape.py` does the fusing. Megatron names are those
of the local (torch) layer spec; `TE_ALIASES` renames the norms Transformer Engine fuses.
Layer and expert ids in the tables are global; `resolve` maps a rank's local ids to them.
A vision-language model keeps its language model under another HF prefix (`language_prefix`),
its vision tower under one copied as-is (`verbatim`), and its experts fused per layer in the
files (`fused_experts`); the tables name the per-expert tensors, which the weight sync sends and
vLLM loads, and the loader / exporter (un)stack them for files.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache

import torch

from dapo_megatron.models.names import under
from dapo_megatron.models.qwen3_vl import build_vision_tower
from dapo_megatron.models.registry import get_arch

# Transformer Engine's spec fuses the pre-attention / dense pre-MLP norms into the next linear.
TE_ALIASES = {
    "decoder.layers.{}.self_attention.linear_qkv.layer_norm_weight": "decoder.layers.{}.input_layernorm.weight",
    "decoder.layers.{}.mlp.linear_fc1.layer_norm_weight": "decoder.layers.{}.pre_mlp_layernorm.weight",
}
# Megatron's TP sharding per parameter: the dim split over (expert-)TP ranks; absent: replicated.
# Column-parallel layers split their output rows (0), row-parallel ones their input columns (1).
# Kept as data rather than read from param attributes: Megatron 0.16 only sets those attributes
# when it initialises the weights (`perform_initialization=True`).
TP_DIM = {
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
    "decoder.layers.{}.self_attention.linear_qkv.weight": 0,
    "decoder.layers.{}.self_attention.linear_qkv.bias": 0,
    "decoder.layers.{}.self_attention.linear_proj.weight": 1,
    "decoder.layers.{}.mlp.linear_fc1.weight": 0,
    "decoder.layers.{}.mlp.linear_fc2.weight": 1,
    "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.weight": 0,
    "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight": 1,
}
# Fused Megatron tensors: the order of their HF parts.
FUSED_PARTS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
_PART_KIND = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gate_up", "up": "gate_up"}
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


@dataclass
class ParamMap:
    """Where one Megatron parameter comes from in HF: its HF names by part, and how it is fused."""
    mcore_name: str  # the rank-local Megatron name
    kind: str  # copy | qkv | gate_up
    hf_names: dict = field(default_factory=dict)  # part -> HF name (part None for kind copy)
    is_expert: bool = False
    is_vocab: bool = False
    tp_dim: int | None = None  # dim split over TP (expert-TP for experts); None: replicated


def _table(model_type: str) -> dict:
    """HF -> Megatron names of `model_type`; get_arch's ValueError names the supported ones."""
    return get_arch(model_type).names


def mcore_to_hf_table(model_type: str) -> dict:
    """Inverse table: Megatron template -> (kind, {part: HF template})."""
    inverse: dict = {}
    for hf_name, target in _table(model_type).items():
        mcore, part = target if isinstance(target, tuple) else (target, None)
        kind = _PART_KIND[part] if part else "copy"
        inverse.setdefault(mcore, (kind, {}))[1][part] = hf_name
    return inverse


def split_ids(mcore_name: str) -> tuple[str, int | None, int | None]:
    """'decoder.layers.3.mlp.experts.local_experts.1.x' -> ('decoder.layers.{}...local_experts.{}.x', 3, 1)."""
    layer = expert = None
    m = _LAYER.match(mcore_name)
    if m:
        layer = int(m.group(1))
        mcore_name = _LAYER.sub("decoder.layers.{}.", mcore_name, count=1)
    m = _EXPERT.search(mcore_name)
    if m:
        expert = int(m.group(1))
        mcore_name = _EXPERT.sub(".local_experts.{}.", mcore_name, count=1)
    return mcore_name, layer, expert


def resolve(mcore_name: str, model_type: str, *, global_layer: dict, expert_offset: int,
            tied: bool) -> ParamMap:
    """The HF source of a rank-local Megatron parameter (layer / expert ids made global).

    `global_layer`: local layer index -> global layer id of this chunk; `expert_offset`:
    experts_per_rank * ep_rank. Raises KeyError naming the parameter when no table row matches.
    """
    for mc_prefix, hf_prefix in get_arch(model_type).verbatim.items():
        if mcore_name.startswith(mc_prefix):
            return ParamMap(mcore_name, "copy", {None: hf_prefix + mcore_name[len(mc_prefix):]})
    template, layer, expert = split_ids(mcore_name)
    template = TE_ALIASES.get(template, template)
    row = mcore_to_hf_table(model_type).get(template)
    if row is None:
        raise KeyError(f"Megatron parameter {mcore_name!r} has no HF name in the {model_type} table")
    kind, parts = row
    ids = [i for i in (global_layer[layer] if layer is not None else None,
                       expert + expert_offset if expert is not None else None) if i is not None]
    hf_names = {part: hf.format(*ids) for part, hf in parts.items()}
    if tied and template == "output_layer.weight":  # the last PP stage's copy of the embedding
        hf_names = {None: mcore_to_hf_table(model_type)["embedding.word_embeddings.weight"][1][None]}
    return ParamMap(mcore_name, kind, hf_names, is_expert=expert is not None,
                    is_vocab=template in VOCAB_PARAMS, tp_dim=TP_DIM.get(template))


# Full HF shape of each tensor, in named dims of the model (`ModelSpec.dims`); checked from the file
# headers before any worker starts, so a misshapen tensor is reported by name up front.
_TEXT_SHAPES = {
    "model.embed_tokens.weight": ("vocab", "hidden"),
    "lm_head.weight": ("vocab", "hidden"),
    "model.norm.weight": ("hidden",),
    "model.layers.{}.input_layernorm.weight": ("hidden",),
    "model.layers.{}.post_attention_layernorm.weight": ("hidden",),
    "model.layers.{}.self_attn.q_proj.weight": ("q_dim", "hidden"),
    "model.layers.{}.self_attn.k_proj.weight": ("kv_dim", "hidden"),
    "model.layers.{}.self_attn.v_proj.weight": ("kv_dim", "hidden"),
    "model.layers.{}.self_attn.q_proj.bias": ("q_dim",),
    "model.layers.{}.self_attn.k_proj.bias": ("kv_dim",),
    "model.layers.{}.self_attn.v_proj.bias": ("kv_dim",),
    "model.layers.{}.self_attn.o_proj.weight": ("hidden", "q_dim"),
    "model.layers.{}.self_attn.q_norm.weight": ("head_dim",),
    "model.layers.{}.self_attn.k_norm.weight": ("head_dim",),
    "model.layers.{}.mlp.gate_proj.weight": ("ffn", "hidden"),
    "model.layers.{}.mlp.up_proj.weight": ("ffn", "hidden"),
    "model.layers.{}.mlp.down_proj.weight": ("hidden", "ffn"),
    "model.layers.{}.mlp.gate.weight": ("experts", "hidden"),
    "model.layers.{}.mlp.experts.{}.gate_proj.weight": ("moe_ffn", "hidden"),
    "model.layers.{}.mlp.experts.{}.up_proj.weight": ("moe_ffn", "hidden"),
    "model.layers.{}.mlp.experts.{}.down_proj.weight": ("hidden", "moe_ffn"),
}


@cache
def hf_shapes(model_type: str) -> dict[str, tuple[str, ...]]:
    """{HF name template: named dims} of `model_type`'s language model."""
    return under(get_arch(model_type).language_prefix, _TEXT_SHAPES)


def _expand(template: str, num_layers: int, num_experts: int) -> list[str]:
    """A table template's names: one per layer, per (layer, expert), or the name itself."""
    n = template.count("{}")
    if n == 0:
        return [template]
    if n == 1:
        return [template.format(l) for l in range(num_layers)]
    return [template.format(l, e) for l in range(num_layers) for e in range(num_experts)]


def expected_hf_shapes(spec, files: bool = True) -> dict[str, tuple[int, ...]]:
    """{HF name: full shape} of every tensor a complete checkpoint of `spec` (a ModelSpec) holds;
    a tied model has no lm_head. `files`: fused experts as the files hold them (official layout),
    else the per-expert tensors of the tables (what the weight sync sends)."""
    dims, shapes = spec.dims, hf_shapes(spec.model_type)
    out = {}
    for template in _table(spec.model_type):
        if spec.tie_word_embeddings and template == "lm_head.weight":
            continue
        shape = tuple(dims[d] for d in shapes[template])
        out.update((name, shape) for name in _expand(template, spec.num_layers, spec.num_experts))
    if files:
        for fused, (stacked, (rows, cols)) in fused_experts(spec).items():
            for name in stacked:
                del out[name]
            out[fused] = (spec.num_experts, cols, rows)  # official: each expert's rows transposed
    if get_arch(spec.model_type).verbatim:
        out.update(vision_tower_shapes(spec))
    return out


def fused_experts(spec) -> dict[str, tuple[list[str], tuple[int, int]]]:
    """{fused file tensor: (per-expert names it stacks, expert by expert and part by part;
    (rows, cols) of one expert's parts concatenated)} of `spec`; {} for a model without them."""
    out = {}
    for template, parts in get_arch(spec.model_type).fused_experts.items():
        stem = template.rsplit(".", 1)[0]  # model.language_model.layers.{}.mlp.experts
        part_shape = tuple(spec.dims[d] for d in hf_shapes(spec.model_type)[f"{stem}.{{}}.{parts[0]}.weight"])
        for layer in range(spec.num_layers):
            names = [f"{stem.format(layer)}.{e}.{p}.weight" for e in range(spec.num_experts) for p in parts]
            out[template.format(layer)] = (names, (part_shape[0] * len(parts), part_shape[1]))
    return out


def vision_tower_shapes(spec) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} of the vision tower's parameters, from a tower built on the meta device
    (its config says more than a table could: depth, deepstack mergers, patch sizes)."""
    # Kept by the tower's config: the plan asks once per rank and per tried response length
    # (27 meta builds, 12 s, for one VL --max-response); the answer never changes.
    key = (spec.model_type, json.dumps(spec.vision_config, sort_keys=True, default=str))
    if key not in _VISION_SHAPES:
        _VISION_SHAPES[key] = _build_vision_tower_shapes(spec)
    return dict(_VISION_SHAPES[key])


_VISION_SHAPES: dict[tuple[str, str], dict[str, tuple[int, ...]]] = {}


def _build_vision_tower_shapes(spec) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        tower = build_vision_tower(spec)
    hf_prefix = next(iter(get_arch(spec.model_type).verbatim.values()))
    return {hf_prefix + name: tuple(p.shape) for name, p in tower.named_parameters()}
