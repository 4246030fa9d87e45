"""The reference policy: the frozen initial model, forward-only log-probs for the KL loss.

    ref = Reference(cfg.ref, cfg.model.path, dtype="bf16")
    rows = ref.compute_logprobs(batch)      # this rank's Rows of [B, T] log-probs, or None

Between uses its weights can live in host memory (`ref.offload`): `compute_logprobs` moves them
to the device and back (`train/offload.py`; on a CPU the host copy is real, the memory stays put).
"""
from __future__ import annotations


from dapo_megatron.batch import RolloutBatch
from dapo_megatron.config.schema import RefConfig
from dapo_megatron.device import get_device
from dapo_megatron.models import ModelSpec
from dapo_megatron.train import logprobs as lp
from dapo_megatron.train.actor import build_chunks
from dapo_megatron.train.offload import Offloader, module_tensors


class Reference:
    def __init__(self, cfg: RefConfig, hf_dir: str, *, spec: ModelSpec | None = None, dtype: str = "fp32",
                 temperature: float = 1.0, max_tokens_per_microbatch: int = 16384):
        self.cfg, self.temperature, self.max_tokens = cfg, temperature, max_tokens_per_microbatch
        self.spec = spec = spec or ModelSpec.from_pretrained(hf_dir)
        self.chunks = build_chunks(spec, hf_dir, cfg.parallel, dtype=dtype)
        for chunk in self.chunks:
            chunk.requires_grad_(False)
            chunk.eval()
        self.offloader = Offloader({"params": module_tensors(self.chunks)}, get_device(), keep=("params",))
        if cfg.offload:
            self.offloader.offload(["params"])

    def compute_logprobs(self, batch: RolloutBatch, local: bool = False) -> lp.Rows | None:
        """This rank's rows of the response tokens' log-probs under the reference model (see
        `logprobs.compute_logprobs`)."""
        self.offloader.onload(["params"])
        try:
            return lp.compute_logprobs(self.chunks, self.spec.arch, batch, max_tokens=self.max_tokens,
                                       vocab_size=self.spec.vocab_size, temperature=self.temperature, local=local)
        finally:
            if self.cfg.offload:
                self.offloader.offload(["params"])
