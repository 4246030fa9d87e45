"""The checkouts a bench compares: a baseline commit in a temporary git worktree, and this one.
Each run of a tree starts its processes in it (`cwd`), with this venv: `python -m` and pytest
import the tree's own `dapo_megatron` first."""
from __future__ import annotations

import contextlib
import os
import subprocess

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout


@contextlib.contextmanager
def checkouts(baseline: str, tmp: str):
    """Yields [(name, tree)]: the baseline's worktree under `tmp` first (none: none), then this
    checkout; the worktree is removed afterwards."""
    here = [("this checkout", HERE)]
    if baseline == "none":
        yield here
        return
    base = os.path.join(tmp, "baseline")
    subprocess.run(["git", "worktree", "add", "-f", base, baseline], cwd=HERE, check=True, capture_output=True)
    try:
        yield [(baseline, base), *here]
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", base], cwd=HERE, capture_output=True)
