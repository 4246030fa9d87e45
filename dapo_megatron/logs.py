"""Library output of the Ray actors goes to the run folder; the console keeps our lines.

vLLM, Megatron and torch print from every training rank and engine (INFO lines at each weight
sync, FutureWarnings, Apex fallbacks): useful in a file, noise on a console meant to show one
line per step. Each actor points its stdout and stderr at `<run dir>/logs/<name>.log` at the
file-descriptor level, so C++ and subprocess output follows; our own warnings (loggers under
`dapo_megatron`) still reach the console through the original stderr, which Ray forwards.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Optional

LOGS = "logs"


def log_file(run_dir: str, name: str) -> str:
    return os.path.join(run_dir, LOGS, f"{name}.log")


_console = None  # the original stderr, once redirect_output moved fd 2 to a log file


def console():
    """Where a line meant for the user goes (a progress bar): the original stderr of a process
    whose output `redirect_output` sent to a file, else sys.stderr."""
    return _console or sys.stderr


@contextlib.contextmanager
def stderr_to(path: Optional[str]):
    """Within the block, fd 2 points at `path` (appending): a child process started here (the
    rank forkserver, whose imports warn) writes its stderr there for good, its stdout stays the
    console; this process gets its stderr back after the block."""
    if not path:
        yield
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def redirect_output(path: Optional[str], console_fd: int = 2) -> None:
    """Send this process's stdout and stderr to `path` (appending: a resumed run adds to it).
    `console()` and our loggers keep `console_fd` as it was (1 in a forkserver child, whose
    stderr is the server's log)."""
    global _console
    if not path:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    console = _console = os.fdopen(os.dup(console_fd), "w", buffering=1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    handler = logging.StreamHandler(console)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger("dapo_megatron").addHandler(handler)
