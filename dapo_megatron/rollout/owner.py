"""One thread owns an object that is not thread-safe (vLLM's in-process engine): it steps it while
there is work and runs every other operation as a command between two steps. Other threads post
commands, or call and wait for the result, failing fast if the owning thread died meanwhile."""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional


class OwnerThread:
    """busy(): whether to step now (else wait for a command); step(): one step of the owned object.
    An exception in a step ends the thread; callers then get it instead of waiting forever."""

    def __init__(self, busy: Callable[[], bool], step: Callable[[], None], name: str):
        self._busy, self._step = busy, step
        self._commands: queue.Queue = queue.Queue()
        self._stop = False
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            busy = self._busy()
            try:
                fn, fut = self._commands.get(block=not busy, timeout=None if busy else 0.5)
            except queue.Empty:
                fn = None
            if fn is not None:
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001  (handed to the caller's thread)
                    fut.set_exception(e)
                continue  # drain every pending command before the next step
            if busy:
                try:
                    self._step()
                except BaseException as e:  # noqa: BLE001  (callers see it instead of hanging)
                    self.error = e
                    return

    def post(self, fn: Callable) -> None:
        """Run fn on the owning thread between two steps, without waiting for it."""
        self._commands.put((fn, Future()))

    def call(self, fn: Callable, timeout: Optional[float] = None):
        """Run fn on the owning thread between two steps; returns its result."""
        if threading.current_thread() is self._thread:
            return fn()
        fut: Future = Future()
        self._commands.put((fn, fut))
        return self.wait(lambda t: fut.result(t), timeout)

    def wait(self, get: Callable[[float], object], timeout: Optional[float] = None):
        """get(1.0) until it answers, failing fast if the owning thread died meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return get(1.0)
            except (TimeoutError, queue.Empty):
                if not self._thread.is_alive():
                    raise RuntimeError(f"the {self._thread.name} thread stopped: {self.error!r}") from self.error
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"engine call did not finish in {timeout} s")

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self.call(lambda: setattr(self, "_stop", True))
            self._thread.join(timeout=timeout)
