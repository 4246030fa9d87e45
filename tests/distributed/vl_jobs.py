"""Worker jobs of test_vl_model.py, run on every rank of a local gloo group. The weights come
from the HF dir through the project's loader (`load_hf_checkpoint`, the name tables of
`weights/name_map.py`), as the trainer and the converter load them.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from dapo_megatron.config.schema import ParallelConfig


def _build(hf_dir: str, parallel: dict):
    """(coords, spec, chunks) of the tiny VL model at `parallel`, weights from the HF dir."""
    from dapo_megatron.models import ModelSpec, build_model
    from dapo_megatron.train.parallel import init_parallel
    from dapo_megatron.weights import load_hf_checkpoint
    info = init_parallel(ParallelConfig(**parallel))
    spec = ModelSpec.from_pretrained(hf_dir)
    chunks = build_model(spec, dtype="fp32", perform_initialization=False)
    load_hf_checkpoint(chunks, hf_dir)
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


def vl_exports(hf_dir: str, parallel: dict) -> dict:
    """Load `hf_dir` (official expert layout) through the tables, then export it both ways and
    compare with the file: gather (the converter's: fused experts, official layout) and what this
    rank's weight sync sends (`sync.owned_tensors`: experts per expert, global ids). Returns the
    names each yielded and those not bit-identical to the file."""
    from dapo_megatron.weights import HFCheckpoint, iter_hf_tensors
    from dapo_megatron.weights.load import UnstackedExperts
    from dapo_megatron.weights.sync import owned_tensors
    _, spec, chunks = _build(hf_dir, parallel)
    ckpt = HFCheckpoint(hf_dir)
    out = {}
    for mode, items, source in (("gather", iter_hf_tensors(chunks), ckpt),
                                ("sent", owned_tensors(chunks), UnstackedExperts(ckpt, spec))):
        names, bad = [], []
        for name, tensor in items:
            names.append(name)
            ref = source.read(name)
            if ref.dtype != tensor.dtype or ref.shape != tensor.shape or not torch.equal(ref, tensor):
                bad.append(name)
        out[mode] = dict(names=names, bad=bad)
    return out
