"""The process that `train.parallel.run_workers` forks its ranks from (light: the standard library
and logs.py, so that convert starts it before its own imports).

Ranks are forks of a multiprocessing "forkserver" that has already imported torch, megatron-core
and the HF config classes (`_forkserver_preload`): ~10 s of CPU per fresh interpreter on our
2-core machines, which a 4-rank conversion used to pay 4 times. The server is a clean
single-threaded process, so forking it is safe where forking the caller (OpenMP pools, Ray,
NCCL threads) is not. There is one per process, shared with the reward pool's: whichever starts
it first sets what is preloaded, and a rank imports whatever is missing itself.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

from dapo_megatron.logs import stderr_to

PRELOAD = ["dapo_megatron.train._forkserver_preload"]


def context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start(log_path: str = "") -> None:
    """Start the server now: it imports in the background while the caller goes on (the convert
    CLI reads and checks its input meanwhile); the first rank started waits for it. With
    `log_path`, a server started here writes its stderr (the imports' warnings) there."""
    context()
    with stderr_to(log_path):
        multiprocessing.forkserver.ensure_running()
