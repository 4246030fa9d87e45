"""ModelSpec: the model's shape, read once from its HF config and handed to everything else.

Validation (`config/validate.py`), the Megatron builder (`models/gpt.py`), the weight name maps
and loaders (`weights/`) all read this record, never the raw HF config: a config that nests the
language model under `text_config` (vision-language models) or renames a field is handled here
once. The `Arch` row of `model_type` says how to build and call the model.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from dapo_megatron.models.registry import Arch, get_arch


def _as_dict(hf: Any) -> dict:
    """A transformers PretrainedConfig or a plain config.json dict -> a dict (nested ones too)."""
    return hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)


def _rope(text: Mapping) -> tuple[Optional[float], str]:
    """(rope base, rope type); transformers 5 keeps both in `rope_parameters`, older configs use
    `rope_theta` / `rope_scaling`."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = params.get("rope_theta", text.get("rope_theta"))
    kind = params.get("rope_type", params.get("type", "default"))
    return (None if theta is None else float(theta)), kind


@dataclass(frozen=True)
class ModelSpec:
    model_type: str  # the top-level HF model_type: picks the `Arch` row and the name tables
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int  # dense MLP
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope_theta: Optional[float]
    rope_type: str = "default"
    max_position_embeddings: Optional[int] = None
    num_experts: int = 0  # 0: dense
    moe_ffn_hidden_size: int = 0
    moe_top_k: int = 0
    norm_topk_prob: bool = True
    # Vision-language (Qwen3-VL): the T/H/W bands of the rotary frequencies (empty: a 1-D RoPE)
    # and the token id the image embeddings replace. The vision tower's own config is `vision_config`.
    mrope_section: tuple[int, ...] = ()
    image_token_id: Optional[int] = None
    hf: Any = field(default=None, compare=False, repr=False)  # the config it came from (builders may need more)

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelSpec":
        """From a transformers config or a config.json dict, flat or with a nested `text_config`."""
        top = _as_dict(hf)
        if "model_type" not in top:
            raise ValueError("the HF config has no model_type")
        text = {**top, **top["text_config"]} if isinstance(top.get("text_config"), dict) else top
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
                   if k not in text]
        if missing:
            raise ValueError(f"the HF config ({top['model_type']}) has no {', '.join(missing)}")
        heads = text["num_attention_heads"]
        theta, rope_type = _rope(text)
        experts = text.get("num_experts") or text.get("num_local_experts") or 0
        if experts and (text.get("decoder_sparse_step", 1) != 1 or text.get("mlp_only_layers")):
            raise ValueError(f"{top['model_type']} with dense layers between the MoE ones (decoder_sparse_step != 1 "
                             "or mlp_only_layers) is not supported")
        # A nested text config is what the engines read, so its tie flag wins over the top one.
        tied = text.get("tie_word_embeddings", top.get("tie_word_embeddings", False))
        return cls(
            model_type=top["model_type"], vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
            num_layers=text["num_hidden_layers"], num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or text["hidden_size"] // heads,
            ffn_hidden_size=text.get("intermediate_size") or 0, rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(tied), rope_theta=theta, rope_type=rope_type,
            max_position_embeddings=text.get("max_position_embeddings"),
            num_experts=experts, moe_ffn_hidden_size=(text.get("moe_intermediate_size") or 0) if experts else 0,
            moe_top_k=(text.get("num_experts_per_tok") or 0) if experts else 0,
            # Qwen3-VL-MoE's text config has no norm_topk_prob: its router always renormalises.
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            mrope_section=tuple((text.get("rope_parameters") or text.get("rope_scaling") or {}).get("mrope_section") or ()),
            image_token_id=top.get("image_token_id"), hf=hf)

    def __getstate__(self) -> dict:
        # A transformers config pickles by its class: every process a spec is sent to (the
        # training ranks) would import transformers for it, ~2 s of a core each at every start.
        # The readers of `hf` take a dict as well.
        state = dict(self.__dict__)
        if state["hf"] is not None:
            state["hf"] = _as_dict(state["hf"])
        return state

    @classmethod
    def from_pretrained(cls, hf_dir: str) -> "ModelSpec":
        """From a checkpoint dir's config.json, through transformers' AutoConfig (which fills the
        defaults a config.json may leave out), or the plain JSON for a model_type it lacks."""
        from transformers import AutoConfig
        try:
            return cls.from_hf(AutoConfig.from_pretrained(hf_dir))
        except (KeyError, ValueError) as exc:
            path = os.path.join(hf_dir, "config.json")
            if not os.path.isfile(path):
                raise ValueError(f"{hf_dir} has no config.json") from exc
            with open(path) as f:
                return cls.from_hf(json.load(f))

    @property
    def arch(self) -> Arch:
        return get_arch(self.model_type)

    @property
    def vision_config(self) -> Optional[dict]:
        """The HF `vision_config` of a vision-language model as a dict; None for a text model."""
        vision = _as_dict(self.hf).get("vision_config") if self.hf is not None else None
        return None if vision is None else _as_dict(vision)

    @property
    def is_vision_language(self) -> bool:
        """Whether the model has a vision tower (the HF config's `vision_config`): the one answer
        that validation, the engines (images per prompt) and the trainer's inputs all read."""
        return self.vision_config is not None

    @property
    def deepstack_layers(self) -> int:
        """How many of the first decoder layers get the vision tower's intermediate features added
        (Qwen3-VL deepstack: one per `deepstack_visual_indexes` entry); 0 for a text model."""
        return len((self.vision_config or {}).get("deepstack_visual_indexes") or ())

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dims(self) -> dict[str, int]:
        """Named sizes, the words the weight shape tables (`weights/name_map.hf_shapes`) use."""
        return dict(vocab=self.vocab_size, hidden=self.hidden_size, head_dim=self.head_dim,
                    q_dim=self.num_heads * self.head_dim, kv_dim=self.num_kv_heads * self.head_dim,
                    ffn=self.ffn_hidden_size, experts=self.num_experts, moe_ffn=self.moe_ffn_hidden_size)
