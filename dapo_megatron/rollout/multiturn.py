"""Multi-turn rollouts (`rollout.multi_turn`): a response is model turn, tool messages, model
turn, ... A model turn that ends calling tools runs them off the engine's loop thread; their
messages (in the chat template) are appended, and the next turn is a new child request of the
whole sequence (its prefix cached), until an answer, `max_turns` or `max_tokens` in all.

This is a request feature (rollout/requests.py) on top of child submission: it keeps each
child's `Conversation`, the tokenizer, the tool runner and the turn policy; vLLM stays the
engine's.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Optional

from dapo_megatron.batch import Prompt
from dapo_megatron.rollout.requests import Feature, Requests, _Live
from dapo_megatron.rollout.types import RolloutGroup
from dapo_megatron.toolcall.conversation import Conversation, tool_turn_ids
from dapo_megatron.toolcall.parse import Parsed, parse_tool_calls
from dapo_megatron.toolcall.registry import ToolRunner, load_tools
from dapo_megatron.toolcall.sandbox import Limits

if TYPE_CHECKING:
    from dapo_megatron.rollout.engine_spec import EngineSpec


class ToolTurns(Feature):
    """post(fn): run fn on the engine's loop thread (where `requests` may be touched)."""

    def __init__(self, spec: "EngineSpec", requests: Requests, post: Callable[[Callable], None]):
        from transformers import AutoTokenizer
        self.cfg, self.requests, self.post = spec.rollout.multi_turn, requests, post
        self.tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path or spec.model_path)
        limits = Limits(wall_s=self.cfg.tool_timeout_s, cpu_s=max(1, int(self.cfg.tool_timeout_s)),
                        output_chars=self.cfg.max_tool_output_chars)
        # The runner's own deadline is a little later than the interpreter's, so a slow
        # interpreter reports its own timeout; it bounds user tools that never return.
        self.runner = ToolRunner(load_tools(list(spec.rollout.tools), limits), pool=self.cfg.tool_pool,
                                 timeout_s=self.cfg.tool_timeout_s + 5)
        # As many conversations may wait on their tools at once as the engine holds requests.
        self._stages = ThreadPoolExecutor(max_workers=max(1, spec.rollout.max_concurrent_per_engine),
                                          thread_name_prefix="tool-stage")
        tool_turn_ids(self.tokenizer, ["check"])  # a template without a tool role fails here, at start

    def on_add(self, live: _Live, prompt: Prompt) -> None:
        n, g = len(live.children), live.group
        live.state["conversations"] = [Conversation() for _ in range(n)]
        g.loss_masks, g.turns = [[] for _ in range(n)], [1] * n
        g.tool_stats = dict.fromkeys(RolloutGroup.TOOL_STATS, 0.0)

    def on_output(self, live: _Live, i: int, out, logprobs: list[float]) -> None:
        live.state["conversations"][i].add_model(out.outputs[0].token_ids, logprobs)

    def on_finish(self, live: _Live, i: int, completion) -> bool:
        conv = live.state["conversations"][i]
        parsed = self._calls(conv) if completion.finish_reason == "stop" else None
        if parsed is None:
            return False
        live.children[i] = None  # in its tools; the next turn is a new request
        self._stages.submit(self._run_tools, live, i, conv, parsed)
        return True

    def on_done(self, live: _Live, i: int) -> None:
        """The conversation is the response: model and tool tokens, their mask and accounting."""
        conv, g = live.state["conversations"][i], live.group
        g.responses[i], g.rollout_logprobs[i], g.loss_masks[i] = conv.tokens, conv.logprobs, conv.mask
        g.turns[i] = conv.turns
        for key in g.tool_stats:
            g.tool_stats[key] += getattr(conv, key)

    def _calls(self, conv: Conversation) -> Optional[Parsed]:
        """The calls of the turn that just ended, or None when the conversation ends here: no
        call (an answer), a call cut by the length limit, or `max_turns` reached."""
        text = self.tokenizer.decode(conv.turn_tokens(), skip_special_tokens=False)
        parsed = parse_tool_calls(text, self.cfg.format)
        if parsed.cut or not (parsed.calls or parsed.errors) or conv.turns >= self.cfg.max_turns:
            return None
        return parsed

    def _run_tools(self, live: _Live, i: int, conv: Conversation, parsed: Parsed) -> None:
        """On a tool-stage thread: run the calls, then hand their messages' tokens to the loop."""
        try:
            outcomes = self.runner.run(parsed.calls)  # never raises: failures are messages
            conv.tool_calls += len(parsed.calls) + len(parsed.errors)
            conv.tool_errors += len(parsed.errors) + sum(o.error for o in outcomes)
            conv.tool_timeouts += sum(o.timeout for o in outcomes)
            conv.tool_s += sum(o.seconds for o in outcomes)
            ids = tool_turn_ids(self.tokenizer, parsed.errors + [o.message for o in outcomes])
        except Exception as e:  # noqa: BLE001 - a conversation must never hang on its tools
            ids = tool_turn_ids(self.tokenizer, [f"error: {type(e).__name__}: {e}"])
        self.post(lambda: self._next_turn(live, i, ids))

    def _next_turn(self, live: _Live, i: int, tool_ids: list[int]) -> None:
        """Child i's tools answered: append their tokens and submit its next turn (loop thread)."""
        if i in live.done:
            return  # aborted while its tools ran
        conv, budget = live.state["conversations"][i], live.sampling.max_tokens
        if not conv.add_tool(tool_ids, budget):
            live.group.finish_reasons[i] = "length"
            self.requests.finish_child(live, i)
            return
        ids = list(live.group.prompt) + conv.tokens
        self.requests.submit_child(live, i, f"{live.group.request_id}#{i}.{conv.turns}", ids,
                                   max_tokens=budget - len(conv.tokens))

    def close(self) -> None:
        self._stages.shutdown(wait=False, cancel_futures=True)
        self.runner.close()
