"""Tools by name: the built-in Python interpreter and user functions (`rollout.tools` entries
`path/to/file.py:function`, loaded like `reward.custom_fn`), run concurrently on a bounded pool.

A tool is a function of keyword arguments returning text. Its JSON schema (what the chat
template shows the model) is the function's `schema` attribute if it has one, else read from its
signature and docstring. Whatever happens in a call (unknown tool, wrong arguments, an
exception, a timeout) comes back as the tool message; a call never raises into the rollout.
"""
from __future__ import annotations

import dataclasses
import inspect
import time
import typing
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable, Sequence

from dapo_megatron.toolcall.parse import ToolCall
from dapo_megatron.toolcall.sandbox import Limits, Result, run_python

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., str]
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}


@dataclass(frozen=True)
class Outcome:
    """One call's tool message, and how it went (for rollout/tool_errors, rollout/tool_timeouts)."""
    message: str
    error: bool = False
    timeout: bool = False
    seconds: float = 0.0  # time the tool ran (not the wait for a free slot of the pool)


def _python_tool(limits: Limits) -> Callable[..., Result]:
    def python(code: str) -> Result:
        """Run Python code and return what it prints (stdout and stderr). Use print() to see values."""
        return run_python(code, limits)
    return python


def schema_of(name: str, fn: Callable) -> dict:
    """The function's own `schema`, else one from its signature (annotated types) and docstring."""
    if isinstance(getattr(fn, "schema", None), dict):
        return fn.schema
    params = inspect.signature(fn).parameters
    hints = typing.get_type_hints(fn)
    props = {p: {"type": _JSON_TYPES.get(hints.get(p), "string")} for p in params}
    required = [p for p, v in params.items() if v.default is inspect.Parameter.empty]
    return {"type": "function", "function": {"name": name, "description": inspect.getdoc(fn) or "",
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


# Built-in tools by name: each a factory of the tool function from the sandbox's limits.
BUILTIN: dict[str, Callable[[Limits], Callable[..., Result]]] = {"python": _python_tool}


def load_tools(entries: Sequence[str], limits: Limits = Limits()) -> dict[str, Tool]:
    """`rollout.tools` entries -> tools by name: a built-in name, or `path/to/file.py:function`
    (the tool is named after the function). Errors name `rollout.tools`. limits: the interpreter's."""
    # Here, not at the top: the sandbox's interpreter imports this package (sandbox._BOOT) and
    # must not pay for torch, which the config package imports.
    from dapo_megatron.config import ConfigError, load_custom_fn
    tools: dict[str, Tool] = {}
    for entry in entries:
        if entry in BUILTIN:
            name, fn = entry, BUILTIN[entry](limits)
        elif ":" in entry:
            fn = load_custom_fn(entry, key="rollout.tools")
            name = entry.rpartition(":")[2]
        else:
            raise ConfigError("rollout.tools", f"rollout.tools entry {entry!r} is neither a built-in tool "
                                               f"({', '.join(sorted(BUILTIN))}) nor 'path/to/file.py:function'")
        if name in tools:
            raise ConfigError("rollout.tools", f"rollout.tools names the tool {name!r} twice")
        tools[name] = Tool(name, fn, schema_of(name, fn))
    return tools


class ToolRunner:
    """Runs tool calls on at most `pool` threads (the interpreter's work is in its own process);
    `timeout_s` bounds how long a call's message waits (the interpreter bounds itself). A user
    tool that never returns keeps its thread: user tools should bound their own work."""

    def __init__(self, tools: dict[str, Tool], pool: int = 8, timeout_s: float = 30.0):
        self.tools, self.timeout_s = tools, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=pool, thread_name_prefix="tool")

    def _call(self, call: ToolCall) -> Outcome:
        start = time.monotonic()
        return dataclasses.replace(self._run(call), seconds=time.monotonic() - start)

    def _run(self, call: ToolCall) -> Outcome:
        tool = self.tools.get(call.name)
        if tool is None:
            return Outcome(f"error: unknown tool {call.name!r}; the tools are {', '.join(sorted(self.tools))}", True)
        try:
            inspect.signature(tool.fn).bind(**call.arguments)
        except TypeError as e:
            return Outcome(f"error: {call.name}: {e}", True)
        try:
            out = tool.fn(**call.arguments)
        except Exception as e:  # noqa: BLE001 - the model sees the failure, the step goes on
            return Outcome(f"error: {call.name} raised {type(e).__name__}: {e}", True)
        if isinstance(out, Result):  # the interpreter says itself whether it failed or ran out of time
            return Outcome(out.message(), not out.ok, out.error.startswith("timeout") or "SIGXCPU" in out.error)
        return Outcome(str(out))

    def run(self, calls: Sequence[ToolCall]) -> list[Outcome]:
        """Each call's outcome, in order; the calls run concurrently."""
        futures = [self._pool.submit(self._call, c) for c in calls]
        out = []
        for call, fut in zip(calls, futures):
            try:
                out.append(fut.result(timeout=self.timeout_s))
            except FutureTimeout:
                out.append(Outcome(f"error: {call.name} did not finish in {self.timeout_s:g} s", True, True,
                                   self.timeout_s))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
