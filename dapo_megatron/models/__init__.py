"""HF config -> ModelSpec -> Megatron-Core model chunks.

    spec = ModelSpec.from_pretrained(hf_dir)     # once; validation and the weight maps read it too
    chunks = build_model(spec, dtype="fp32")     # after train.parallel.init_parallel(...)

Each chunk carries `chunk.spec`, so the weight maps (`weights/`) know the architecture.
"""
from __future__ import annotations

from dapo_megatron.device import get_device
from dapo_megatron.models.gpt import have_transformer_engine, padded_vocab_size, transformer_config  # noqa: F401
from dapo_megatron.models.registry import Arch, get_arch  # noqa: F401
from dapo_megatron.models.spec import ModelSpec  # noqa: F401


def build_model(spec: ModelSpec, *, dtype: str = "fp32", sequence_parallel: bool = False,
                use_te: bool | None = None, device=None, **overrides) -> list:
    """Build this rank's model chunks (one per VPP stage) for `spec`.

    Parallel state must be initialised (`train.parallel.init_parallel`), which also seeds every
    rank identically; the degrees are read through `dapo_megatron.parallel.coords()`. Sequence
    parallel is forced on when TP > 1 with MoE. On CPU the params are created on the host
    (`use_cpu_initialization`).
    """
    device = device or get_device()
    arch = spec.arch
    use_te = have_transformer_engine() if use_te is None else use_te
    tf_config = transformer_config(spec, arch, dtype=dtype, sequence_parallel=sequence_parallel,
                                   use_cpu_initialization=not device.is_accelerator, **overrides)
    chunks = arch.build_fn(spec, arch, tf_config, use_te=use_te)
    for chunk in chunks:  # on an accelerator Megatron already created the params on the device
        chunk.spec = spec
        # torch norms of the local spec ignore params_dtype and stay fp32; cast the params (not
        # buffers such as RoPE frequencies), as Megatron's Float16Module would.
        for p in chunk.parameters():
            if p.is_floating_point() and p.dtype != tf_config.params_dtype:
                p.data = p.data.to(tf_config.params_dtype)
    return chunks
