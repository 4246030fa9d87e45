"""Tool calls in a model's output, per chat-template format (a table row each).

Qwen2.5 / Qwen3 and Hermes templates ask the model to write

    <tool_call>
    {"name": "python", "arguments": {"code": "print(123 * 456)"}}
    </tool_call>

one block per call, several per turn allowed. A block whose JSON is broken, or that names no
tool, becomes an error the model is told about (a tool message), never an exception; a block
opened but not closed (the response hit its length limit) is reported as `cut`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from dapo_megatron.toolcall_formats import FORMATS


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class Parsed:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per malformed block, for the model
    cut: bool = False  # a block opened and never closed: the response was cut inside a call


def _decode(body: str, n: int) -> ToolCall | str:
    """A block's JSON -> ToolCall, or the error line the model gets back."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"tool call {n}: not valid JSON ({e.msg} at character {e.pos})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return f'tool call {n}: expected {{"name": ..., "arguments": {{...}}}}'
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return f"tool call {n}: arguments are a string that is not JSON"
    if not isinstance(args, dict):
        return f"tool call {n}: arguments must be an object, got {type(args).__name__}"
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str, fmt: str = "hermes") -> Parsed:
    """Every tool-call block of `text` in the format `fmt` (a key of FORMATS)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; one of {sorted(FORMATS)}")
    f = FORMATS[fmt]
    calls, errors, pos, n = [], [], 0, 0
    while True:
        start = text.find(f.open, pos)
        if start < 0:
            return Parsed(calls, errors)
        end = text.find(f.close, start + len(f.open))
        if end < 0:
            return Parsed(calls, errors, cut=True)
        n += 1
        got = _decode(text[start + len(f.open):end].strip(), n)
        (calls if isinstance(got, ToolCall) else errors).append(got)
        pos = end + len(f.close)
