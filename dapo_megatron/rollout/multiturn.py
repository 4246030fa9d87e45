"""What an engine does between the turns of a multi-turn request (`rollout.multi_turn`): read the
calls out of a finished model turn, run the tools off the engine's loop thread, and hand back the
tokens (tool messages in the chat template) that the next turn starts after.

The engine keeps the conversations and the vLLM requests; this module keeps the tokenizer, the
tool runner and the turn policy, so the engine stays the one place that drives vLLM.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from dapo_megatron.toolcall.conversation import Conversation, tool_turn_ids
from dapo_megatron.toolcall.parse import Parsed, parse_tool_calls
from dapo_megatron.toolcall.registry import ToolRunner, load_tools
from dapo_megatron.toolcall.sandbox import Limits


class ToolLoop:
    """cfg: `rollout.multi_turn`; tools: `rollout.tools` entries; stages: how many conversations
    may wait on their tools at once (the engine's request capacity)."""

    def __init__(self, cfg, tools: list[str], tokenizer_path: str, stages: int):
        from transformers import AutoTokenizer
        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        limits = Limits(wall_s=cfg.tool_timeout_s, cpu_s=max(1, int(cfg.tool_timeout_s)),
                        output_chars=cfg.max_tool_output_chars)
        # The runner's own deadline is a little later than the interpreter's, so a slow
        # interpreter reports its own timeout; it bounds user tools that never return.
        self.runner = ToolRunner(load_tools(tools, limits), pool=cfg.tool_pool, timeout_s=cfg.tool_timeout_s + 5)
        self._stages = ThreadPoolExecutor(max_workers=max(1, stages), thread_name_prefix="tool-stage")
        tool_turn_ids(self.tokenizer, ["check"])  # a template without a tool role fails here, at start

    def calls(self, conv: Conversation) -> Optional[Parsed]:
        """The calls of the turn that just ended, or None when the conversation ends here: no
        call (an answer), a call cut by the length limit, or `max_turns` reached."""
        text = self.tokenizer.decode(conv.turn_tokens(), skip_special_tokens=False)
        parsed = parse_tool_calls(text, self.cfg.format)
        if parsed.cut or not (parsed.calls or parsed.errors) or conv.turns >= self.cfg.max_turns:
            return None
        return parsed

    def start(self, conv: Conversation, parsed: Parsed, then: Callable[[list[int]], None]) -> None:
        """Run the calls on the tool pool, then `then(tool token ids)` from that pool's thread."""
        def stage():
            try:
                outcomes = self.runner.run(parsed.calls)  # never raises: failures are messages
                conv.tool_calls += len(parsed.calls) + len(parsed.errors)
                conv.tool_errors += len(parsed.errors) + sum(o.error for o in outcomes)
                conv.tool_timeouts += sum(o.timeout for o in outcomes)
                conv.tool_s += sum(o.seconds for o in outcomes)
                ids = tool_turn_ids(self.tokenizer, parsed.errors + [o.message for o in outcomes])
            except Exception as e:  # noqa: BLE001 - a conversation must never hang on its tools
                ids = tool_turn_ids(self.tokenizer, [f"error: {type(e).__name__}: {e}"])
            then(ids)
        self._stages.submit(stage)

    def close(self) -> None:
        self._stages.shutdown(wait=False, cancel_futures=True)
        self.runner.close()
