"""The one place that starts torch.distributed and sets up Megatron-Core's model-parallel state,
and the local launcher of worker ranks (`run_workers`).

Megatron owns TP / PP / VPP / EP / ETP / CP (one `initialize_model_parallel` call); DP is what is
left of the world. The degrees were validated at the entry point (`config/validate.py`, or the
convert CLI), so this module only asserts them. Everyone, train/ included, reads the layout
through the ground floor's `dapo_megatron.parallel` (`coords()`, `group()`), never parallel_state.
"""
from __future__ import annotations

import contextlib
import os
import random
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

from dapo_megatron.config.schema import ParallelConfig
from dapo_megatron.device import Device, get_device
from dapo_megatron.logs import redirect_output, stderr_to
from dapo_megatron.parallel import Coords, coords, free_port
from dapo_megatron.train.forkserver import context


def _assert_fits(cfg: ParallelConfig, world: int) -> None:
    # The entry points validated the layout with messages naming the key; this only guards.
    assert world % (cfg.tp * cfg.pp * cfg.cp) == 0 and world % (cfg.etp * cfg.ep * cfg.pp) == 0, \
        f"parallel layout {cfg} does not fit a world of {world} (not validated at the entry point?)"


def _init_process_group(device: Device, timeout_s: int) -> None:
    """Start torch.distributed from the usual env vars (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    if dist.is_initialized():
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device.set_device(local_rank)
    dist.init_process_group(backend=device.dist_backend, timeout=timedelta(seconds=timeout_s),
                            rank=int(os.environ.get("RANK", "0")),
                            world_size=int(os.environ.get("WORLD_SIZE", "1")))


def seed_all(seed: int, device: Device | None = None) -> None:
    """Seed Python's, torch's and Megatron's RNG tracker identically on every rank.

    Without it replicated parameters (norms, router) are initialised differently on each TP rank
    and a checkpoint round trip drifts (seen: 3.5e-4 loss mismatch). Python's generator is in
    every checkpoint's RNG state: unseeded, two runs of one config saved different ones.
    """
    from megatron.core import tensor_parallel
    random.seed(seed)
    (device or get_device()).manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def init_parallel(cfg: ParallelConfig, device: Device | None = None, *, seed: int = 1234,
                  timeout_s: int = 1800) -> Coords:
    """Initialise torch.distributed (if needed) and Megatron's parallel state from `cfg`."""
    device = device or get_device()
    device.setup_megatron()
    _init_process_group(device, timeout_s)
    _assert_fits(cfg, dist.get_world_size())
    from megatron.core import parallel_state as mpu
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp if cfg.vpp > 1 else None,
        context_parallel_size=cfg.cp, expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.etp, distributed_timeout_minutes=max(1, -(-timeout_s // 60)))
    seed_all(seed, device)
    return coords()


@contextlib.contextmanager
def fake_rank(cfg: ParallelConfig, rank: int, world: int):
    """This process as `rank` of `world` over torch's fake process group, Megatron's parallel
    state initialised over it (its gloo groups made fake too: the distributed optimizer asks for
    them); yields the rank's Coords. For real shapes built on the meta device (plan/build.py)."""
    from megatron.core import parallel_state as mpu
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    new_group = dist.new_group

    def fake_gloo(*args, **kwargs):
        if kwargs.get("backend") == "gloo":
            kwargs["backend"] = None
        return new_group(*args, **kwargs)
    dist.new_group = fake_gloo
    try:
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
            virtual_pipeline_model_parallel_size=cfg.vpp if cfg.vpp > 1 else None, context_parallel_size=cfg.cp,
            expert_model_parallel_size=cfg.ep, expert_tensor_parallel_size=cfg.etp)
        dist.new_group = new_group
        yield coords()
    finally:
        dist.new_group = new_group
        destroy_parallel()


def destroy_parallel() -> None:
    """Tear down Megatron's parallel state and the process group (safe to call twice)."""
    from megatron.core import parallel_state as mpu
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Local launcher: N worker processes on this machine, without torchrun (convert CLI, tests).


class WorkerError(RuntimeError):
    """A worker failed; `args[0]` is its one-line message, `.details` the tracebacks."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


def _worker(rank: int, world: int, port: int, env: dict, fn, args, queue, log_path: str) -> None:
    # A forkserver child inherits the server's environment, not the caller's: restore the
    # caller's as of run_workers (tests and launchers set variables right before).
    redirect_output(log_path, console_fd=1)  # the server's stderr may be a log already
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    get_device().setup_process(world)
    try:
        queue.put((rank, True, fn(*args), ""))
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which decides)
        queue.put((rank, False, str(e) or type(e).__name__, traceback.format_exc()))
    finally:
        destroy_parallel()


def run_workers(fn, world_size: int, *args, timeout_s: float = 600.0, log_path: str = "") -> list:
    """Run `fn(*args)` in `world_size` new processes (RANK/WORLD_SIZE/MASTER_* set for
    `init_parallel`); returns their results by rank. On a failure the other workers, which may
    be blocked in a collective, are killed and WorkerError carries the lowest failing rank's
    message. A run longer than `timeout_s` is killed and raises TimeoutError. With `log_path`
    the workers' library output goes there (`logs.console()` still reaches the user).
    """
    ctx = context()
    queue, port, env = ctx.Queue(), free_port(), dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, env, fn, args, queue, log_path))
             for r in range(world_size)]
    with stderr_to(log_path):  # a server started by the first rank writes there too
        for p in procs:
            p.start()
    results, failures = {}, {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < world_size:
            if failures:  # give the others a moment to report the same (agreed) error
                deadline = min(deadline, time.monotonic() + 5)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value, tb = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty: check for workers that died without reporting
                if any(p.exitcode not in (None, 0) for p in procs) and not failures:
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    failures[dead[0]] = (f"worker {dead[0]} died with exit code {procs[dead[0]].exitcode}", "")
                continue
            (results if ok else failures)[rank] = value if ok else (value, tb)
    finally:
        for p in procs:
            if p.is_alive() and (failures or len(results) < world_size):
                p.kill()
            p.join(timeout=30)
    if failures:
        rank = min(failures)
        raise WorkerError(failures[rank][0], "\n".join(tb for _, tb in failures.values()))
    if len(results) < world_size:
        raise TimeoutError(f"workers did not finish within {timeout_s:.0f} s")
    return [results[r] for r in range(world_size)]
