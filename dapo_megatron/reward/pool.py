"""Persistent worker processes that score (response, ground truth) pairs under a hard deadline.

Why processes: math-verify holds the GIL (threads give no speed-up) and its own timeout is
`signal.alarm`, which only works in a main thread. Here each worker is the main thread of its own
process, the parent never touches signals, and a pair over `timeout_s` costs only its worker:
the parent SIGKILLs it, scores the pair -1 (reason "timeout") and starts a replacement. So
`score_batch` may be called from any thread, a Ray actor included, and always returns.

The parent runs the linear-time part itself (`prescreen`: extraction, safety caps, exact match,
and the row's scorer's `finish`, e.g. geo3k's format term), so megabyte responses and refused
answers never cross a pipe; workers only run math-verify. `data_sources` picks each row's scorer
(reward/scorers.py); without it every row gets the math reward.

Workers come from a "forkserver" (a clean single-threaded server process that has math-verify
preloaded) so that a restart is a fork, not a fresh interpreter; never a plain fork of a parent
that runs threads (Ray, NCCL, the HTTP server).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import wait
from typing import Sequence

from dapo_megatron.reward.math_score import (ERROR, TIMEOUT, WORKER_DIED, RewardResult, make_result,
                                             math_verify_equal, prescreen, warm_up)
from dapo_megatron.reward.scorers import scorers_for

logger = logging.getLogger(__name__)

_PRELOAD = ["__main__", "dapo_megatron.reward._forkserver_preload"]
_MAX_START_FAILURES = 3
_PIPELINE = 2  # pairs queued per worker: one running, one ready to start without a round trip


def default_num_workers() -> int:
    """One worker per core this process may run on (cgroup / taskset aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _worker_main(conn) -> None:
    """Worker loop: receive (index, pred, ground_truth), send back (index, RewardResult)."""
    # Ctrl-C goes to the whole process group; shutdown is the parent's decision.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        warm_up()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    _exit_with_parent()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        index, pred, ground_truth = msg
        try:
            result = make_result(math_verify_equal(pred, ground_truth), pred)
        except Exception:  # noqa: BLE001 - a sympy bug on one answer must not cost a restart
            result = make_result(False, pred, ERROR)
        conn.send((index, result))


def _exit_with_parent() -> None:
    """A worker stuck in sympy never reads its pipe again, so it could outlive a parent killed by
    SIGKILL; a daemon thread notices the re-parenting (the forkserver exits with the parent) and
    exits the process."""
    parent_pid = os.getppid()

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)
    threading.Thread(target=watch, daemon=True, name="reward-parent-watch").start()


class _Worker:
    """One process, the parent's end of its pipe, and the pairs sent to it."""

    def __init__(self, ctx):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child_conn,), daemon=True,
                                name="reward-worker")
        self.ready = False
        self.jobs: deque[tuple[int, str, str]] = deque()  # sent, unanswered: (index, pred, truth)
        self.head_since = 0.0  # when the worker could start jobs[0]: its deadline counts from here
        self.started = time.monotonic()
        self.proc.start()
        child_conn.close()  # so that the parent sees EOF when the worker dies

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5.0)
        self.conn.close()


class RewardPool:
    """`num_workers` processes (0: one per core) scoring pairs with a `timeout_s` deadline each.

    Counters (cumulative, for metrics): `timeouts`, `restarts`, `crashes`, `scored`.
    """

    def __init__(self, num_workers: int = 0, timeout_s: float = 5.0, start_method: str = "forkserver",
                 startup_timeout_s: float = 120.0):
        if timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {timeout_s}")
        if num_workers < 0:
            raise ValueError(f"reward.num_workers must be >= 0 (0: one per core), got {num_workers}")
        self.num_workers = num_workers or default_num_workers()
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = startup_timeout_s
        self.timeouts = self.restarts = self.crashes = self.scored = 0
        self._start_failures = 0  # consecutive workers that died before "ready"
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload(_PRELOAD)
        self._lock = threading.Lock()
        self._closed = False
        self._workers: list[_Worker] = []
        try:
            self._workers = [_Worker(self._ctx) for _ in range(self.num_workers)]
            for w in self._workers:
                self._await_ready(w)
        except BaseException:
            for w in self._workers:
                w.kill()
            raise

    def score_batch(self, responses: list[str], ground_truths: list[str],
                    data_sources: Sequence[str] | None = None) -> list[RewardResult]:
        """Score pairs in parallel, each by its data source's scorer (None: math for all); results
        in input order. Never hangs on one pair."""
        if len(responses) != len(ground_truths):
            raise ValueError(f"score_batch: {len(responses)} responses but {len(ground_truths)} "
                             "ground truths")
        scorers = scorers_for(data_sources, len(responses))
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            results: list[RewardResult | None] = [None] * len(responses)
            pending: deque[tuple[int, str, str]] = deque()  # (index, pred, ground truth)
            for i, (response, truth) in enumerate(zip(responses, ground_truths)):
                t0 = time.monotonic()
                try:
                    pred, results[i] = prescreen(response, str(truth), scorers[i].extract)
                except Exception:  # noqa: BLE001 - a bug here must not cost the whole batch
                    pred, results[i] = "", make_result(False, "", ERROR)
                if results[i] is None:
                    pending.append((i, pred, str(truth)))
                else:
                    results[i].elapsed_s = time.monotonic() - t0
            try:
                # Replacements from the last batch take ~0.03 s to start; waiting for them keeps
                # the pairs spread over all workers instead of queued behind the ready ones.
                while pending and not all(w.ready for w in self._workers):
                    self._collect(pending, results)
                while pending or any(w.jobs for w in self._workers):
                    self._dispatch(pending, results)
                    self._collect(pending, results)
            except BaseException:  # KeyboardInterrupt, a replacement that cannot start
                self._abandon_in_flight()
                raise
            self.scored += len(results)
            # A timed-out or dead worker's pair is a wrong answer to its scorer, like any other.
            return [s.finish(r, response) for s, r, response in zip(scorers, results, responses)]

    def _dispatch(self, pending: deque, results: list) -> None:
        """Queue up to _PIPELINE pairs at each worker, round-robin, so that it never waits for the
        parent's round trip; a deadline still blames one pair, the head of the worker's queue."""
        for depth in range(1, _PIPELINE + 1):
            for w in list(self._workers):
                if not (w.ready and len(w.jobs) < depth and pending):
                    continue
                job = pending.popleft()
                try:
                    w.conn.send(job)
                except OSError:  # died while idle (OOM killer, a kill): its pairs go elsewhere
                    pending.appendleft(job)
                    self._replace(w, pending, results, WORKER_DIED)
                    continue
                if not w.jobs:
                    w.head_since = time.monotonic()
                w.jobs.append(job)

    def _collect(self, pending: deque, results: list) -> None:
        """Wait for the next reply, readiness or deadline; handle timeouts and dead workers."""
        deadlines = [w.head_since + self.timeout_s for w in self._workers if w.jobs]
        deadlines += [w.started + self.startup_timeout_s for w in self._workers if not w.ready]
        conns = {w.conn: w for w in self._workers if w.jobs or not w.ready}
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        for conn in wait(list(conns), timeout=timeout):
            w = conns[conn]
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                if not w.ready:  # a worker that can never start must not be restarted forever
                    self._start_failures += 1
                    if self._start_failures > _MAX_START_FAILURES:
                        w.proc.join(timeout=5.0)
                        raise RuntimeError(f"reward workers keep exiting at start (last exit code "
                                           f"{w.proc.exitcode})")
                self._replace(w, pending, results, WORKER_DIED)
                continue
            if not w.ready:
                self._on_startup_message(w, msg)
                continue
            index, result = msg
            if index != w.jobs[0][0]:
                raise RuntimeError(f"reward worker answered pair {index}, expected {w.jobs[0][0]}")
            now = time.monotonic()
            result.elapsed_s, w.head_since = now - w.head_since, now
            results[index] = result
            w.jobs.popleft()
        now = time.monotonic()
        expired = [w for w in self._workers if w.jobs and now - w.head_since > self.timeout_s]
        for w in expired:  # SIGKILL all first: reaping and restarting one must not delay another
            w.proc.kill()
        for w in expired:
            self._replace(w, pending, results, TIMEOUT, now)
        if any(not w.ready and now - w.started > self.startup_timeout_s for w in self._workers):
            raise RuntimeError(f"reward worker did not start within {self.startup_timeout_s} s")

    def _replace(self, w: _Worker, pending: deque, results: list, reason: str,
                 now: float | None = None) -> None:
        """Kill `w`: its head pair scores -1 with `reason`, the pairs queued behind it go back to
        `pending`; start a replacement."""
        if w.jobs:
            index, pred, _ = w.jobs.popleft()
            elapsed = (now or time.monotonic()) - w.head_since
            results[index] = make_result(False, pred, reason, elapsed)
            pending.extendleft(reversed(w.jobs))
        w.kill()
        if reason == TIMEOUT:
            self.timeouts += 1
        else:
            self.crashes += 1
            logger.warning("reward worker pid %s died (exit code %s); restarting", w.proc.pid,
                           w.proc.exitcode)
        self._workers[self._workers.index(w)] = _Worker(self._ctx)
        self.restarts += 1

    def _abandon_in_flight(self) -> None:
        """Replies still in flight after an aborted batch would land in the next one: kill the
        busy workers and start fresh ones."""
        for i, w in enumerate(self._workers):
            if w.jobs:
                w.kill()
                self._workers[i] = _Worker(self._ctx)
                self.restarts += 1

    def _on_startup_message(self, w: _Worker, msg) -> None:
        kind, payload = msg
        if kind != "ready":
            w.kill()
            raise RuntimeError(f"reward worker failed to start (math-verify import?):\n{payload}")
        w.ready = True
        self._start_failures = 0

    def _await_ready(self, w: _Worker) -> None:
        if not w.conn.poll(self.startup_timeout_s):
            w.kill()
            raise RuntimeError(f"reward worker did not start within {self.startup_timeout_s} s")
        try:
            self._on_startup_message(w, w.conn.recv())
        except EOFError:
            w.proc.join(timeout=5.0)
            raise RuntimeError(f"reward worker exited at start (exit code {w.proc.exitcode}); a script "
                               "that creates a RewardPool needs `if __name__ == '__main__':`") from None

    @property
    def pids(self) -> list[int]:
        """Worker process ids (for monitoring; they change on restart)."""
        return [w.proc.pid for w in self._workers]

    def stats(self) -> dict[str, int]:
        return {"timeouts": self.timeouts, "restarts": self.restarts, "crashes": self.crashes,
                "scored": self.scored}

    def close(self) -> None:
        """Stop the workers (politely, then SIGKILL after 2 s). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for w in self._workers:
                try:
                    w.conn.send(None)
                except OSError:
                    pass
            for w in self._workers:
                w.proc.join(timeout=2.0)
                if w.proc.is_alive():
                    w.kill()
                else:
                    w.conn.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
