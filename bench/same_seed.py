"""Does one seed give one run? Each training mode run twice with the same seeds and config, with
trainer.deterministic and without, compared by `python -m dapo_megatron.tools.same_run`.

    python bench/same_seed.py [--steps 6] [--modes "sync, early stop" ...] [key=value ...]

`quickstart_async`'s layout (split placement on the two cores: one training rank, one engine,
early-stop dynamic sampling as shipped), `--steps` steps, a checkpoint every half of them (under
the key a save drains the batches asked ahead) and at the end, no validation. Per mode and
setting: whether the two runs wrote the same metrics (every key but the clocks and memory) and
checkpoints (every tensor and field), or the first difference; and both runs' wall seconds.
What the e2e tests compare on the tiny task (recipe rounds, async with partial rollouts, killed
and resumed) this measures on the demo's task in every mode, the streamed one included.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import run_main  # noqa: E402  (bench scripts sit side by side, not in a package)
from results import Table, write  # noqa: E402

CONFIG = "quickstart_async"
MODES = {  # name -> overrides of quickstart_async (shipped: async, max_staleness 2, partial rollouts)
    "sync, recipe rounds": ["trainer.mode=sync", "trainer.max_staleness=1", "algorithm.filter_groups.mode=sync"],
    "sync, early stop": ["trainer.mode=sync", "trainer.max_staleness=1"],
    "one_step_off, mini-batches streamed": ["trainer.mode=one_step_off", "trainer.max_staleness=1",
                                            "trainer.stream_minibatches=true", "actor.ppo_mini_batch_size=8"],
    "async k=2, pushes drain": ["trainer.partial_rollout=false"],
    "async k=1, partial rollouts": ["trainer.max_staleness=1"],
}
SETTINGS = {"default": [], "deterministic": ["trainer.deterministic=true"]}


def pair(overrides: list[str], steps: int, tmp: str, name: str) -> tuple[list[str], list[float]]:
    """Two runs of one config: what differs (same_run's lines; none: the same run), their wall seconds."""
    from dapo_megatron.tools import same_run
    runs, walls = [], []
    for i in range(2):
        out = os.path.join(tmp, f"{name}-{i}")
        result = run_main(CONFIG, [f"trainer.total_training_steps={steps}", f"trainer.save_freq={max(steps // 2, 1)}",
                                   "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
                                   "trainer.resume_mode=disable", *overrides], out_dir=out, timeout=1800)
        runs.append(Path(out))
        walls.append(result.wall_s)
    return same_run.compare(*runs), walls


def short(lines: list[str]) -> str:
    """same_run's lines without their values: where the runs part, and how much."""
    return "; ".join(": ".join(line.split(": ")[:2]) for line in lines) or "the same"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    p.add_argument("overrides", nargs="*", help="key=value for every run")
    args = p.parse_args()
    rows, found = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            for setting, extra in SETTINGS.items():
                name = f"{len(rows)}"
                lines, walls = pair([*MODES[mode], *extra, *args.overrides], args.steps, tmp, name)
                found[f"{mode} / {setting}"] = lines
                rows.append([mode, setting, short(lines), " / ".join(f"{w:.0f}" for w in walls)])
                print(rows[-1], flush=True)
    write("same_seed", title="One seed, one run: each mode twice with the same seeds",
          measures=f"{CONFIG}'s layout (one training rank, one vLLM-CPU engine, early stop as shipped), "
                   f"{args.steps} steps, a checkpoint every {max(args.steps // 2, 1)}, no validation; each mode and "
                   "setting run twice with the same seeds and compared by dapo_megatron.tools.same_run: metrics "
                   "but the clocks and memory, checkpoints tensor by tensor.",
          tables=[Table("modes", f"Two runs of each mode and setting, {args.steps} steps",
                        ["mode", "trainer.deterministic", "the two runs", "wall s (each run)"], rows)],
          extra={"differences": found})


if __name__ == "__main__":
    main()
