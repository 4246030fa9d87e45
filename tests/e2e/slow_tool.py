"""A user tool for tests (`rollout.tools: [tests/e2e/slow_tool.py:python]`): the real interpreter,
answering 1 s late, under the built-in's name and schema (the prompts the model sees do not change)."""
import time

from dapo_megatron.toolcall.registry import BUILTIN, schema_of
from dapo_megatron.toolcall.sandbox import Limits, run_python


def python(code: str):
    time.sleep(1.0)
    return run_python(code, Limits())


python.schema = schema_of("python", BUILTIN["python"](Limits()))
