"""Worker jobs of test_vl_model.py, run on every rank of a local gloo group.

The Qwen3-VL-MoE weights are copied here from the transformers model's state dict by
`copy_hf_weights`: the project's name maps (`weights/name_map.py`) have no qwen3_vl_moe table yet
(the text part sits under `model.language_model.`, the experts are fused 3-D tensors and the
vision tower's names are not layer-templated), so `load_hf_checkpoint` cannot load this model.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from dapo_megatron.config.schema import ParallelConfig
from dapo_megatron.weights import name_map, reshape


def _text_rows() -> dict:
    """Megatron template -> (kind, {part: HF template}) of the text part: Qwen3-MoE's rows under the
    VL checkpoint's `model.language_model.` prefix; the experts are fused in HF (`_hf_expert`)."""
    rows = {}
    for mcore, (kind, parts) in name_map.mcore_to_hf_table("qwen3_moe").items():
        if ".experts." not in mcore:
            rows[mcore] = (kind, {p: hf.replace("model.", "model.language_model.", 1) for p, hf in parts.items()})
    return rows


def _hf_expert(hf: dict, template: str, layer: int, expert: int) -> torch.Tensor:
    # transformers' in-memory layout: gate_up_proj [E, 2I, H] (gate rows first, as Megatron's
    # linear_fc1), down_proj [E, H, I] (= linear_fc2's [H, I]).
    stem = f"model.language_model.layers.{layer}.mlp.experts."
    return hf[stem + ("gate_up_proj" if template.endswith("linear_fc1.weight") else "down_proj")][expert]


def _full_tensor(name: str, hf: dict, spec, geo: dict, rows: dict) -> torch.Tensor:
    """The TP-1 Megatron tensor of the rank-local parameter `name`."""
    if name.startswith("visual."):
        return hf["model." + name]  # the HF tower itself: same names under model.visual.
    template, layer, expert = name_map.split_ids(name)
    layer = geo["global_layer"][layer] if layer is not None else None
    if expert is not None:
        return _hf_expert(hf, template, layer, expert + geo["expert_offset"])
    kind, parts = rows[template]
    src = {p: hf[n.format(layer) if layer is not None else n] for p, n in parts.items()}
    if kind == "qkv":  # grouped per query group: a row split over TP gives each rank its groups
        return reshape.qkv_to_mcore(src["q"], src["k"], src["v"], num_groups=spec.num_kv_heads, head_dim=spec.head_dim)
    assert kind == "copy", kind
    return src[None]


def copy_hf_weights(chunk, hf: dict) -> None:
    """Copy a transformers Qwen3-VL-MoE state dict into this rank's Megatron chunk (TP / EP / PP;
    expert-TP 1)."""
    from dapo_megatron.weights.load import chunk_geometry
    geo, spec, rows = chunk_geometry(chunk), chunk.spec, _text_rows()
    assert geo["etp"][0] == 1, "copy_hf_weights splits experts over EP only"
    for name, param in chunk.named_parameters():
        full = _full_tensor(name, hf, spec, geo, rows)
        template = name_map.split_ids(name)[0]
        if template in name_map.VOCAB_PARAMS:  # Megatron pads the vocab rows for TP
            full = reshape.pad_vocab(full, param.shape[0] * geo["tp"][0])
        dim = None if ".experts." in name else name_map.TP_DIM.get(template)
        if dim is not None and geo["tp"][0] > 1:
            full = full.chunk(geo["tp"][0], dim=dim)[geo["tp"][1]]
        assert full.shape == param.shape, (name, full.shape, param.shape)
        with torch.no_grad():
            param.copy_(full)


def _build(hf_dir: str, parallel: dict):
    """(coords, spec, chunks) of the tiny VL model at `parallel`, weights from the HF dir."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from dapo_megatron.models import ModelSpec, build_model
    from dapo_megatron.train.parallel import init_parallel
    info = init_parallel(ParallelConfig(**parallel))
    spec = ModelSpec.from_pretrained(hf_dir)
    chunks = build_model(spec, dtype="fp32", perform_initialization=False)
    hf = Qwen3VLMoeForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    for chunk in chunks:
        copy_hf_weights(chunk, hf)
    return info, spec, chunks


def _micro(fields: dict):
    # What the trainer's forward step reads of a micro-batch: tokens, images, replayed routes.
    return SimpleNamespace(routed_experts=None, **fields)


def vl_logits(hf_dir: str, parallel: dict, micros: list[dict]) -> dict:
    """Full-vocab logits [B, S, V_padded] per micro-batch through the trainer's schedule
    (`train.logprobs.forward_backward`, any PP), on the last stage's TP rank 0 (None elsewhere),
    and the vision tower's parameter attributes as this rank sees them."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from dapo_megatron.train.logprobs import forward_backward
    info, spec, chunks = _build(hf_dir, parallel)
    for chunk in chunks:
        chunk.eval()
    tower = [p for c in chunks if hasattr(c, "visual") for p in c.visual.parameters()]
    attrs = dict(n_tower=len(tower), tp_avg=all(getattr(p, "average_gradients_across_tp_domain", False) for p in tower),
                 tp_split=any(hasattr(p, "tensor_model_parallel") for p in tower))

    def loss_fn(micro, output):  # output [B, S, V/TP]
        logits = gather_from_tensor_model_parallel_region(output).detach()
        return output.new_zeros(()), torch.tensor(0, dtype=torch.int), {"logits": logits}

    with torch.no_grad():
        data = forward_backward(chunks, spec.arch, [_micro(m) for m in micros], loss_fn, forward_only=True)
    logits = [d["logits"].clone() for d in data] if data and info.tp_rank == 0 else None
    return dict(logits=logits, **attrs)


def vl_tower_grads(hf_dir: str, parallel: dict, micro: dict) -> bytes:
    """This rank's gradients of the vision tower ({name: grad}, `actor_jobs.pack`ed: many tensors
    through the result queue hang) after one forward-backward of a token cross-entropy, before
    any cross-rank reduction; {} on ranks without the tower."""
    from actor_jobs import pack
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from dapo_megatron.train.logprobs import forward_backward
    _, spec, chunks = _build(hf_dir, parallel)

    def loss_fn(micro, output):  # output [B, S, V/TP]; targets: the tokens themselves
        loss = vocab_parallel_cross_entropy(output.float(), micro.tokens).sum()
        return loss, torch.tensor(1, dtype=torch.int), {}

    forward_backward(chunks, spec.arch, [_micro(micro)], loss_fn, forward_only=False)
    return pack({n: p.grad for c in chunks if hasattr(c, "visual") for n, p in c.visual.named_parameters()})
