"""Quickstart step time of this checkout against an earlier commit, alternated in one run.

    python bench/quickstart_step_time.py [--baseline 23b9f50] [--rounds 2] [--steps 12]

Checks the baseline commit out into a temporary git worktree and runs the quickstart
(`--steps` steps, no validation, no checkpoints) from each tree in turn, `--rounds` times, with
this venv. Prints the median over steps 3.. of each phase (`timing/*`) and the driver's CPU.
The baseline default is the last commit before the data plane.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

PHASES = ("timing/step", "timing/gen", "timing/old_logprob", "timing/update", "driver/cpu_s")


def _run(tree: str, out: str, steps: int) -> dict[str, float]:
    subprocess.run([sys.executable, "-m", "dapo_megatron.main", "--config-name", "quickstart",
                    f"trainer.total_training_steps={steps}", "trainer.save_freq=0", "trainer.test_freq=0",
                    "trainer.val_before_train=false", "trainer.logger=[jsonl]", f"trainer.default_local_dir={out}",
                    "trainer.resume_mode=disable"], cwd=tree, check=True, capture_output=True, timeout=1800)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][2:]  # warm-up steps
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in PHASES}  # no old_logprob: on-policy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="23b9f50")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "baseline")
        subprocess.run(["git", "worktree", "add", "-f", base, args.baseline], cwd=here, check=True, capture_output=True)
        rows = []
        try:
            for r in range(args.rounds):
                for name, tree in ((args.baseline, base), ("this checkout", here)):
                    rows.append((f"{name}, {r + 1}", _run(tree, os.path.join(tmp, f"run{r}-{len(rows)}"), args.steps)))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", base], cwd=here, capture_output=True)
    print(f"\nquickstart step time, median of steps 3..{args.steps} (s)")
    print("| run | " + " | ".join(PHASES) + " |\n|" + "---|" * (len(PHASES) + 1))
    for name, med in rows:
        print(f"| {name} | " + " | ".join(f"{med[k]:.3f}" for k in PHASES) + " |")


if __name__ == "__main__":
    main()
