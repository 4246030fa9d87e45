"""What vLLM needs on a CPU that it does not do itself; installed in every engine worker process.

MoE weight updates. vLLM's weight-update path skips the experts' kernel-specific
post-processing, assuming it is a no-op (it is on GPU). On CPU it pads the expert intermediate
size to a multiple of 32 and prepacks both weights for the grouped GEMM. Skipped, an update
copied raw weights into packed storage, so outputs were silently wrong; with an unpadded size
(moe_intermediate 48) the copy failed outright. `_setup_kernel` is made to run that step on
updates too.

Seeded sampling with chunked prefill. When a step prefills only part of a prompt (its tokens
exceed `rollout.max_num_batched_tokens`), vLLM still samples a token for it, discards it, and
rewinds the request's generator with `set_offset(get_offset() - 4)`: a Philox offset, which CPU
generators (Mersenne Twister) do not have, so the engine died (`CPU Generator does not use
offset`). Each seeded request gets a `RewindableGenerator` instead: its state is saved before
every sampling call, and the rewind restores it, so a discarded draw consumes nothing, as on
CUDA. A prompt's responses then depend on its seed only, not on how its prefill was chunked.

Small helpers, eager. vLLM compiles a few helpers with inductor at import (`_EAGER`: the sampled
token's rank, a TP engine's vocabulary mask); on a CPU each is a C++ build in the first call of
every engine process (2-4 s with inductor's cache warm, more on a fresh machine: its precompiled
header alone is ~0.7 GB) for a comparison and a sum. Their own Python runs instead.
"""
from __future__ import annotations

import importlib

import torch


class RewindableGenerator(torch.Generator):
    """A CPU generator whose vLLM "rewind" (`set_offset`) undoes the draws since `save()`."""

    def save(self) -> None:
        self._saved = self.get_state()

    def get_offset(self) -> int:
        return 0  # only read by vLLM to compute the rewind target, which `set_offset` ignores

    def set_offset(self, offset: int) -> "RewindableGenerator":
        self.set_state(self._saved)
        return self


def _rewindable(generator):
    if generator is None or generator.device.type != "cpu" or isinstance(generator, RewindableGenerator):
        return generator
    out = RewindableGenerator()
    out.set_state(generator.get_state())
    return out


def _repack_experts_on_update() -> None:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    if hasattr(UnquantizedFusedMoEMethod, "_dapo_original_setup_kernel"):
        return
    setup_kernel = UnquantizedFusedMoEMethod._setup_kernel

    def _setup_kernel(self, layer, w13, w2):
        updating = self.moe_kernel is not None  # vLLM's own test for "a weight update"
        setup_kernel(self, layer, w13, w2)
        if updating:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    UnquantizedFusedMoEMethod._dapo_original_setup_kernel = setup_kernel
    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel


# (module, function) that vLLM wraps in torch.compile and that our engines call
_EAGER = (("vllm.v1.sample.sampler", "batched_count_greater_than"),
          ("vllm.model_executor.layers.vocab_parallel_embedding", "get_masked_input_and_mask"))


def _uncompiled() -> None:
    for module_name, name in _EAGER:
        module = importlib.import_module(module_name)
        fn = getattr(module, name)
        setattr(module, name, getattr(fn, "_torchdynamo_orig_callable", fn))


def install(model_runner) -> None:
    """Experts repacked on weight updates; seeded requests get rewindable generators; vLLM's
    compiled helpers run eager. Idempotent."""
    _repack_experts_on_update()
    _uncompiled()
    from vllm.v1.worker.gpu_input_batch import CachedRequestState
    if not getattr(CachedRequestState, "_dapo_rewindable", False):
        post_init = CachedRequestState.__post_init__

        def __post_init__(self):
            post_init(self)
            self.generator = _rewindable(self.generator)

        CachedRequestState.__post_init__ = __post_init__
        CachedRequestState._dapo_rewindable = True
    sampler = model_runner.sampler
    if getattr(sampler, "_dapo_saves", False):
        return
    forward = sampler.forward

    def saving_forward(*args, **kwargs):
        for generator in model_runner.input_batch.generators.values():
            if isinstance(generator, RewindableGenerator):
                generator.save()
        return forward(*args, **kwargs)

    sampler.forward = saving_forward
    sampler._dapo_saves = True
