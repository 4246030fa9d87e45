"""Library output of the Ray actors goes to the run folder; the console keeps our lines.

vLLM, Megatron and torch print from every training rank and engine (INFO lines at each weight
sync, FutureWarnings, Apex fallbacks): useful in a file, noise on a console meant to show one
line per step. Each actor points its stdout and stderr at `<run dir>/logs/<name>.log` at the
file-descriptor level, so C++ and subprocess output follows; our own warnings (loggers under
`dapo_megatron`) still reach the console through the original stderr, which Ray forwards.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Optional

LOGS = "logs"


def log_file(run_dir: str, name: str) -> str:
    return os.path.join(run_dir, LOGS, f"{name}.log")


def redirect_output(path: Optional[str]) -> None:
    """Send this process's stdout and stderr to `path` (appending: a resumed run adds to it)."""
    if not path:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    console = os.fdopen(os.dup(2), "w", buffering=1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    handler = logging.StreamHandler(console)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger("dapo_megatron").addHandler(handler)
