"""Qwen3-VL-MoE (HF model_type "qwen3_vl_moe"): transformers' vision tower + a Megatron-Core
GPTModel for the text part.

    pixels --HF vision tower--> image embeddings -> written over the image_token_id embeddings
                           \\-> deepstack features -> added after the first decoder layers
    token ids + image grids --HF get_rope_index--> positions [3, B, S] -> interleaved MRoPE

The tower is the HF module itself, on the first pipeline stage, replicated over TP: every TP
rank runs it on the same pixels, its gradients are averaged over TP by Megatron's
`finalize_model_grads` (`average_gradients_across_tp_domain`) and, having no
`tensor_model_parallel` attribute, it is counted once in the grad norm.

What differs from a GPT, and the max logit error against HF when it is got wrong (the tiny model
of assets.models.TINY_VL_MOE, logits ~1): megatron-core's own `MultimodalRotaryEmbedding`, the
chunked Qwen2-VL band layout, 0.11; 1-D positions, 0.36; deepstack left out, 0.89 (as built
here: ~7e-7 at TP1 / TP2+SP / EP2 / PP2, tests/distributed/test_vl_model.py).
"""
from __future__ import annotations

from functools import cache, partial
from types import SimpleNamespace

import torch

from dapo_megatron.models import gpt
from dapo_megatron.parallel import coords

# megatron is imported only where a model is built: the driver reads the Arch rows too, and on NPU
# MindSpeed must patch megatron before its first import (device.setup_megatron).


def vl_config_kwargs(spec, arch) -> dict:
    """The text model's TransformerConfig kwargs: a GPT's, plus the MRoPE bands."""
    if sum(spec.mrope_section) * 2 != spec.head_dim:
        raise ValueError(f"{spec.model_type}: mrope_section {list(spec.mrope_section)} must sum to head_dim / 2 "
                         f"({spec.head_dim // 2}) (text_config.rope_parameters.mrope_section)")
    return {**gpt.gpt_config_kwargs(spec, arch), "mrope_section": list(spec.mrope_section)}


class InterleavedMRoPE(torch.nn.Module):
    """Qwen3-VL's multimodal RoPE: frequency j of the head_dim/2 rotary frequencies takes its
    position from axis T, H or W laid out T,H,W,T,H,W,... over the first 3 x section entries, the
    rest T (HF `Qwen3VLMoeTextRotaryEmbedding`, vLLM's interleaved mrope). Called as GPTModel
    calls its `MultimodalRotaryEmbedding` (whose chunked Qwen2-VL layout this replaces)."""

    def __init__(self, head_dim: int, rotary_base: float, cp_group=None):
        super().__init__()
        # The same fp32 inverse frequencies as HF's default RoPE and Megatron's.
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.cp_group = cp_group

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group=None) -> torch.Tensor:
        # position_ids [3, B, S] -> rotary angles [S, B, 1, head_dim] (Megatron's RoPE input)
        _, h, w = mrope_section
        inv_freq = self.inv_freq.to(position_ids.device)
        half = inv_freq.shape[0]
        axis = torch.zeros(half, dtype=torch.long, device=position_ids.device)
        axis[1:3 * h:3] = 1
        axis[2:3 * w:3] = 2
        freqs = position_ids.float()[..., None] * inv_freq  # [3, B, S, half]
        freqs = freqs.gather(0, axis.expand(1, *freqs.shape[1:3], half))[0]  # [B, S, half]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :].transpose(0, 1).contiguous()  # [S, B, 1, D]
        cp_group = cp_group if cp_group is not None else self.cp_group
        if cp_group is not None and cp_group.size() > 1:
            from megatron.core.models.common.embeddings.rotary_pos_embedding import get_pos_emb_on_this_cp_rank
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb


def build_vision_tower(spec) -> torch.nn.Module:
    """transformers' Qwen3-VL-MoE vision model from `spec.vision_config`, marked as replicated over TP."""
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel
    tower = Qwen3VLMoeVisionModel._from_config(Qwen3VLMoeVisionConfig.from_dict(spec.vision_config))
    for p in tower.parameters():
        # Megatron 0.16 all-reduces these (averaged) over TP in finalize_model_grads: every TP rank
        # holds a full copy and must apply the same update.
        p.average_gradients_across_tp_domain = True
    return tower


class _VisionLanguage:
    """Mixed into GPTModel (`vl_model_class`): its first stage also holds the vision tower and adds
    the tower's outputs to the embeddings (image positions) and to the outputs of the first
    `spec.deepstack_layers` decoder layers (forward hooks).

    Parameter names stay GPTModel's (`embedding.`, `decoder.`, `output_layer.`) plus `visual.`
    (the HF tower's own names under it). Sequence parallel: the embeddings are built whole
    ([S, B, H]) and scattered here, after the image embeddings are written, and the deepstack
    additions are scattered the same way, so each rank adds its own rows.
    """

    def __init__(self, *, vl_spec, **gpt_kwargs):
        super().__init__(**gpt_kwargs)
        spec = vl_spec  # a keyword of its own: build_gpt_chunks already takes `spec`
        self.image_token_id = spec.image_token_id
        self.rotary_pos_emb = InterleavedMRoPE(self.config.kv_channels, gpt_kwargs["rotary_base"], self.pg_collection.cp)
        self._deepstack = None  # this forward's additions, [S(/TP), B, H] per deepstack layer
        if self.pre_process:
            self.visual = build_vision_tower(spec)
            for i in range(spec.deepstack_layers):
                self.decoder.layers[i].register_forward_hook(partial(self._add_deepstack, i))

    def _add_deepstack(self, index: int, _layer, _args, output):
        # A TransformerLayer returns (hidden_states [S(/TP), B, H], context).
        if self._deepstack is None:
            return output
        hidden, context = output
        return hidden + self._deepstack[index], context

    def _embed(self, input_ids, pixel_values, image_grid_thw, image_mask):
        """Decoder input [S(/TP), B, H] and the deepstack additions (None without images)."""
        embeds = self.embedding(input_ids=input_ids, position_ids=None)  # [S, B, H], not scattered
        deepstack = None
        if pixel_values is not None:
            dtype = next(self.visual.parameters()).dtype
            out = self.visual(pixel_values.to(dtype), grid_thw=image_grid_thw, return_dict=True)
            mask = (input_ids == self.image_token_id if image_mask is None else image_mask)[..., None]  # [B, S, 1]
            if int(mask.sum()) != out.pooler_output.shape[0]:
                raise ValueError(f"{int(mask.sum())} image tokens (id {self.image_token_id}) in the micro-batch, "
                                 f"but its image_grid_thw gives {out.pooler_output.shape[0]} image embeddings")
            # HF fills the image positions in [B, S] order; Megatron's layout is [S, B].
            embeds = embeds.transpose(0, 1).masked_scatter(mask, out.pooler_output.to(embeds.dtype)).transpose(0, 1)
            zeros = embeds.new_zeros(input_ids.shape + embeds.shape[-1:])  # [B, S, H]
            deepstack = [zeros.masked_scatter(mask, f.to(embeds.dtype)).transpose(0, 1).contiguous()
                         for f in out.deepstack_features]
        if self.config.sequence_parallel:
            from megatron.core import tensor_parallel
            embeds = tensor_parallel.scatter_to_sequence_parallel_region(embeds.contiguous())
            deepstack = deepstack and [tensor_parallel.scatter_to_sequence_parallel_region(d) for d in deepstack]
        return embeds.contiguous(), deepstack

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *, pixel_values=None,
                image_grid_thw=None, image_mask=None, **kwargs):
        """input_ids [B, S], position_ids [3, B, S] (`vl_inputs`), pixel_values [N_patches, C*T*P*P]
        and image_grid_thw [N_images, 3] of the images in the micro-batch, in order (or None);
        image_mask [B, S]: the positions the images fill (None: every image_token_id)."""
        if self.pre_process and decoder_input is None:
            decoder_input, self._deepstack = self._embed(input_ids, pixel_values, image_grid_thw, image_mask)
        try:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, **kwargs)
        finally:
            self._deepstack = None  # no later forward may see this micro-batch's images


@cache
def vl_model_class():
    """Qwen3VLModel: GPTModel with the tower, the image embeddings and deepstack."""
    from megatron.core.models.gpt import GPTModel
    return type("Qwen3VLModel", (_VisionLanguage, GPTModel), {})


def build_vl_chunks(spec, arch, tf_config, *, use_te: bool) -> list:
    """Qwen3VLModel chunks: one per virtual pipeline stage, the tower on the first."""
    c = coords()
    first_stage_layers = spec.num_layers // (c.pp * c.vpp)
    if spec.deepstack_layers > first_stage_layers:
        raise ValueError(f"{spec.model_type}: deepstack adds to the first {spec.deepstack_layers} layers, which must "
                         f"all be on the first pipeline stage ({first_stage_layers} layers there); lower parallel.pp")
    if tf_config.recompute_granularity == "full" and spec.deepstack_layers:
        # A recomputed layer would add the deepstack features again inside its checkpoint, and its
        # backward then runs through the tower's graph a second time ("Trying to backward through
        # the graph a second time", measured); selective recompute does not re-run whole layers.
        raise ValueError(f"{spec.model_type}: deepstack does not run under actor.recompute_granularity=full; "
                         "use selective or none")
    # The embeddings are scattered over SP by _embed, after the images are written in.
    return gpt.build_gpt_chunks(spec, arch, tf_config, use_te=use_te, model_cls=vl_model_class(), vl_spec=spec,
                                position_embedding_type="mrope", scatter_embedding_sequence_parallel=False)


def mrope_position_ids(tokens: torch.Tensor, image_grid_thw, spec, image_mask=None) -> torch.Tensor:
    """Positions [3, B, S] of token ids [B, S] with images of `image_grid_thw` [N, 3] at
    `image_mask` [B, S] (None: every image_token_id), by HF's `get_rope_index` (the positions vLLM
    uses too): text runs on from the last image position, so a response continues as text. Right
    padding continues as text too (masked by the loss)."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeModel
    merge = spec.vision_config["spatial_merge_size"]
    # get_rope_index is a method; it reads only the merge size and get_vision_position_ids (static).
    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge)),
                            get_vision_position_ids=partial(Qwen3VLMoeModel.get_vision_position_ids, None))
    image_mask = tokens == spec.image_token_id if image_mask is None else image_mask
    mm_token_type_ids = image_mask.int()  # transformers 5.x: 1 = image, 0 = text
    positions, _ = Qwen3VLMoeModel.get_rope_index(model, tokens, mm_token_type_ids, image_grid_thw=image_grid_thw)
    return positions


def vl_inputs(micro, device, spec) -> dict:
    """Qwen3VLModel inputs of a micro-batch with `.tokens` [B, S] and, when it has images,
    `.pixel_values` [N_patches, C*T*P*P] and `.image_grid_thw` [N_images, 3] (images in order of
    their image tokens, row by row). Only prompt positions (`.prompt_lens`, when the micro-batch
    has them) hold images: a response that samples the image token id has a text token there, as
    in the engine, which embeds and positions generated tokens as text."""
    tokens = micro.tokens.to(device)
    pixels, grids = getattr(micro, "pixel_values", None), getattr(micro, "image_grid_thw", None)
    grids = None if grids is None else grids.to(device)
    image_mask = tokens == spec.image_token_id  # [B, S]
    prompt_lens = getattr(micro, "prompt_lens", None)
    if prompt_lens is not None:
        image_mask &= torch.arange(tokens.shape[1], device=device)[None] < prompt_lens.to(device)[:, None]
    return dict(input_ids=tokens, position_ids=mrope_position_ids(tokens, grids, spec, image_mask),
                attention_mask=None, pixel_values=None if pixels is None else pixels.to(device),
                image_grid_thw=grids, image_mask=image_mask)
