"""A user tool for tests (`rollout.tools: [tests/e2e/slow_tool.py:python]`): the real interpreter,
answering 0.3-2 s late, under the built-in's name and schema (the prompts the model sees do not
change). The delay differs from call to call so that conversations started together do not all
come back in the same poll (with one fixed delay they did, and an early stop then had nothing
left in flight to abort)."""
import itertools
import threading
import time

from dapo_megatron.toolcall.registry import BUILTIN, schema_of
from dapo_megatron.toolcall.sandbox import Limits, run_python

DELAYS_S = (1.0, 0.3, 2.0, 0.6)
_calls, _lock = itertools.count(), threading.Lock()


def python(code: str):
    with _lock:
        k = next(_calls)
    time.sleep(DELAYS_S[k % len(DELAYS_S)])
    return run_python(code, Limits())


python.schema = schema_of("python", BUILTIN["python"](Limits()))
