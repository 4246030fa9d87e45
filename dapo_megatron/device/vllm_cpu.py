"""What vLLM needs on a CPU that it does not do itself; installed in every engine worker process.

Seeded sampling with chunked prefill. When a step prefills only part of a prompt (its tokens
exceed `rollout.max_num_batched_tokens`), vLLM still samples a token for it, discards it, and
rewinds the request's generator with `set_offset(get_offset() - 4)`: a Philox offset, which CPU
generators (Mersenne Twister) do not have, so the engine died (`CPU Generator does not use
offset`). Each seeded request gets a `RewindableGenerator` instead: its state is saved before
every sampling call, and the rewind restores it, so a discarded draw consumes nothing, as on
CUDA. A prompt's responses then depend on its seed only, not on how its prefill was chunked.
"""
from __future__ import annotations

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


def install(model_runner) -> None:
    """Give this worker's seeded requests rewindable generators; idempotent."""
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
