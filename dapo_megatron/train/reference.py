"""The reference policy: the frozen initial model, forward-only log-probs for the KL loss.

    ref = Reference(cfg.ref, cfg.model.path, dtype="bf16")
    rows = ref.compute_logprobs(batch)      # this rank's Rows of [B, T] log-probs, or None

Between uses its weights can live in host memory (`ref.offload`): `compute_logprobs` moves them
to the accelerator and back. On a CPU both places are the same and nothing moves.
"""
from __future__ import annotations

import torch

from dapo_megatron.batch import RolloutBatch
from dapo_megatron.config.schema import RefConfig
from dapo_megatron.device import get_device
from dapo_megatron.models import ModelSpec
from dapo_megatron.train import logprobs as lp
from dapo_megatron.train.actor import build_chunks


def move_params(chunks: list, device: torch.device) -> None:
    """Move every parameter and buffer of `chunks` to `device` in place (keeps Parameter objects)."""
    for chunk in chunks:
        for t in list(chunk.parameters()) + list(chunk.buffers()):
            if t.device != device:
                t.data = t.data.to(device, non_blocking=True)


class Reference:
    def __init__(self, cfg: RefConfig, hf_dir: str, *, spec: ModelSpec | None = None, dtype: str = "fp32",
                 temperature: float = 1.0, max_tokens_per_microbatch: int = 16384):
        self.cfg, self.temperature, self.max_tokens = cfg, temperature, max_tokens_per_microbatch
        self.device = get_device()
        self.spec = spec = spec or ModelSpec.from_pretrained(hf_dir)
        self.chunks = build_chunks(spec, hf_dir, cfg.parallel, dtype=dtype)
        for chunk in self.chunks:
            chunk.requires_grad_(False)
            chunk.eval()
        self.home = next(self.chunks[0].parameters()).device  # where Megatron built the weights
        if cfg.offload:
            self.offload()

    def offload(self) -> None:
        """Weights to host memory (no-op on a CPU)."""
        if self.device.is_accelerator:
            move_params(self.chunks, torch.device("cpu"))
            self.device.empty_cache()

    def onload(self) -> None:
        if self.device.is_accelerator:
            move_params(self.chunks, self.home)

    def compute_logprobs(self, batch: RolloutBatch, local: bool = False) -> lp.Rows | None:
        """This rank's rows of the response tokens' log-probs under the reference model (see
        `logprobs.compute_logprobs`)."""
        self.onload()
        try:
            return lp.compute_logprobs(self.chunks, self.spec.arch, batch, max_tokens=self.max_tokens,
                                       vocab_size=self.spec.vocab_size, temperature=self.temperature, local=local)
        finally:
            if self.cfg.offload:
                self.offload()
