"""What the bench scripts share: one launcher for `python -m dapo_megatron.main` runs, one reader
of a run's metrics.jsonl, and the median a bench reports.

    from common import NO_EVAL, median, read_metrics, run_main
    run = run_main("quickstart", [*NO_EVAL, "trainer.total_training_steps=12"], out_dir=out, timeout=1800)
    step_s = median(read_metrics(run.out_dir), "timing/step", skip=2)
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Iterable, Optional

# A run as the benches time it: no validation, no checkpoints, metrics.jsonl only, a fresh start
# (a run dir left by an earlier run is not resumed).
NO_EVAL = ("trainer.save_freq=0", "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
           "trainer.resume_mode=disable")


@dataclasses.dataclass
class RunResult:
    argv: list[str]
    out_dir: str
    wall_s: float  # the command's wall time: start-up, steps, shutdown

    def metrics(self) -> list[dict]:
        return read_metrics(self.out_dir)


def main_argv(config_name: str, overrides: Iterable[str], out_dir: str, entry: Optional[str] = None) -> list[str]:
    """The command line of a run of `config_name` into `out_dir`, with this venv's python;
    `entry`: a script that runs main with the same arguments (tests/faults.py)."""
    return [sys.executable, *([entry] if entry else ["-m", "dapo_megatron.main"]), "--config-name", config_name,
            *overrides, f"trainer.default_local_dir={out_dir}"]


def main_env(tree: Optional[str] = None, env: Optional[dict] = None) -> dict:
    """The run's environment: ours, plus `env`; with `tree` (another checkout, bench/_trees.py)
    its package first on PYTHONPATH, for the driver and every Ray worker (they inherit the
    environment, not the driver's sys.path; the venv's editable install points at this checkout)."""
    out = {**os.environ, **(env or {})}
    if tree is not None:
        out["PYTHONPATH"] = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)
    return out


def run_main(config_name: str, overrides: Iterable[str], *, out_dir: str, tree: Optional[str] = None,
             env: Optional[dict] = None, timeout: Optional[float] = None, log: Optional[str] = None,
             on_start: Optional[Callable[[subprocess.Popen], None]] = None, entry: Optional[str] = None) -> RunResult:
    """Run `python -m dapo_megatron.main --config-name config_name *overrides` into `out_dir` to
    its end; SystemExit with the end of its output if it fails or outlives `timeout` s.
    `tree`: run that checkout (its directory, its package: `main_env`). `log`: its stdout and
    stderr go to that file (else stdout is dropped and stderr kept for the error).
    `on_start(proc)` runs once it started, before the wait: it may start a sampler of the
    process tree (a thread), or poll the process itself until it exits. `entry`: `main_argv`'s."""
    argv = main_argv(config_name, overrides, out_dir, entry)
    sink = open(log, "w") if log else None
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(argv, cwd=tree, env=main_env(tree, env), text=True, stdout=sink or subprocess.DEVNULL,
                                stderr=subprocess.STDOUT if sink else subprocess.PIPE)
        if on_start is not None:
            on_start(proc)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            raise SystemExit(f"{config_name} run outlived {timeout} s:\n{_tail(err, log)}") from None
    finally:
        if sink:
            sink.close()
    if proc.returncode:
        raise SystemExit(f"{config_name} run failed (exit {proc.returncode}):\n{_tail(err, log)}")
    return RunResult(argv, out_dir, time.perf_counter() - t0)


def _tail(err: Optional[str], log: Optional[str], chars: int = 3000) -> str:
    if log:
        with open(log) as f:
            err = f.read()
    return (err or "")[-chars:]


def read_metrics(path: str) -> list[dict]:
    """The rows of a run's metrics.jsonl (`path`: the file or its run dir), one a logged step; a
    last line cut short (a run still writing, or killed in the write) is left out; none: []."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:  # only the last line may be torn: anything else is a broken file
                raise
    return rows


def median(xs, key: Optional[str] = None, skip: int = 0) -> float:
    """statistics.median of `xs`; with `key`, of that metric over the rows after the first `skip`
    (the warm-up steps), a row without it counting 0 (a phase that step did not run)."""
    if key is not None:
        xs = [r.get(key, 0.0) for r in list(xs)[skip:]]
    return statistics.median(xs)
