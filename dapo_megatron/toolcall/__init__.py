"""Tool calls for multi-turn rollouts: parsing the model's calls (`parse`), running them
(`registry`: built-in and user tools on a bounded pool), and the code interpreter's sandbox."""
from dapo_megatron.toolcall.parse import FORMATS, Parsed, ToolCall, parse_tool_calls
from dapo_megatron.toolcall.conversation import Conversation, tool_turn_ids
from dapo_megatron.toolcall.registry import BUILTIN, Outcome, Tool, ToolRunner, load_tools, schema_of
from dapo_megatron.toolcall.sandbox import Limits, Result, run_python

__all__ = ["FORMATS", "Parsed", "ToolCall", "parse_tool_calls", "Conversation", "tool_turn_ids", "BUILTIN", "Outcome", "Tool", "ToolRunner", "load_tools",
           "schema_of", "Limits", "Result", "run_python"]
