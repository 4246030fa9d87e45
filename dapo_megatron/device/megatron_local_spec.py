"""Megatron-Core 0.16.1 without Transformer Engine (the local layer spec): two patches that any
device needs, CPU, a GPU without TE, or Ascend before MindSpeed swaps in its kernels.
"""
from __future__ import annotations

import copy

_INSTALLED = False


def _patch_moe() -> None:
    # Symptom: `NameError: te_general_gemm` in the router of any MoE model without Transformer
    # Engine (0.16.1 only defines the name when TE imports).
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_torch_norm_sequence_parallel() -> None:
    """Symptom: "sequence parallel not supported by torch LayerNorm" (SP is required for MoE with TP).

    The norm math is per token, so it is the same on a sequence shard; what SP needs is that the
    norm weights' grads are all-reduced over TP, which Megatron does for params marked
    `sequence_parallel` (as Transformer Engine's norms mark them).
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    original_new = WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, **kwargs)
        cfg = copy.copy(config)  # a shallow copy skips __post_init__ validation, as intended
        cfg.sequence_parallel = False
        norm = original_new(cls, cfg, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = staticmethod(__new__)


def install() -> None:
    """Apply both patches once per process (idempotent)."""
    global _INSTALLED
    if not _INSTALLED:
        _patch_moe()
        _patch_torch_norm_sequence_parallel()
        _INSTALLED = True
