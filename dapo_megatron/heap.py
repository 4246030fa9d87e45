"""Python's cyclic garbage collector around a role's start.

A role's start imports torch with Megatron or vLLM and builds its model: millions of objects that
live as long as the process. CPython runs a full collection each time the objects it tracks grow
by a quarter, so a start scans that heap again and again,
and every full collection after it scans it once more. `start_up` keeps the collector off while a
start runs, collects once at its end and freezes what survived (gc.freeze: later collections skip
it), as vLLM's engine core does after its own start. Only in processes of a role's own: a frozen
object that dies later in a cycle is never collected.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def start_up() -> Iterator[None]:
    """The collector off for the block (or the decorated call); at its end (an error too) one full
    collection, the survivors frozen, the collector back as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()  # the start's cyclic garbage goes now, not into the frozen heap
        gc.freeze()
        if enabled:
            gc.enable()
