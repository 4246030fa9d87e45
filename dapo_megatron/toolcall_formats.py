"""Tool-call formats: how each chat template marks a tool-call block (a table row each).

A leaf on the ground floor: config validation checks `rollout.multi_turn.format` against it
without importing the tool loop (toolcall/), whose parser reads the markers from here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    open: str
    close: str


FORMATS: dict[str, Format] = {
    "hermes": Format("<tool_call>", "</tool_call>"),  # Qwen2.5, Qwen3, Hermes chat templates
}
