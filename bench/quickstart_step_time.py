"""Quickstart step time by phase: this checkout against an earlier commit, or against itself with
other settings, alternated in one run.

    python bench/quickstart_step_time.py [--baseline 23b9f50] [--rounds 2] [--steps 12]
    python bench/quickstart_step_time.py --config quickstart_async --baseline none --variant "sync:trainer.mode=sync"
    python bench/quickstart_step_time.py --baseline none --variant "no checksums:rollout.sync.verify_every=0" \
        --variant "old-log-prob pass:actor.old_logprobs=recompute" [--ours algorithm.filter_groups.enable=false]

Checks the baseline commit out into a temporary git worktree (unless `--baseline none`) and runs
the quickstart (`--steps` steps, no validation, no checkpoints, plus `--ours` overrides) from each
tree and each `--variant NAME:key=value,...` of this checkout in turn, `--rounds` times, with this
venv. Prints the median over steps 3.. of each phase (`timing/*`; `timing/reward` is the scoring
inside `timing/gen`), what the phases leave of the step, the driver's CPU, and the command's
wall time less all its steps (`start+end`: what every end-to-end test pays per run).
"""
from __future__ import annotations

import argparse
import os
import tempfile

from _trees import HERE, checkouts
from common import NO_EVAL, median, run_main
from results import Table, write

PHASES = ("timing/step", "timing/gen", "timing/trainer_wait", "timing/reward", "timing/old_logprob", "timing/update",
          "timing/sync_wait", "timing/sync", "driver/cpu_s")
WARMUP = 2  # steps left out of the medians
# what `other` is the rest of (one_step_off: trainer_wait and sync_wait are the generation it waits for)
NAMED = ("timing/gen", "timing/trainer_wait", "timing/old_logprob", "timing/update", "timing/sync_wait", "timing/sync")


def _run(tree: str, out: str, steps: int, overrides: list[str], config: str) -> dict[str, float]:
    run = run_main(config, [f"trainer.total_training_steps={steps}", *NO_EVAL, *overrides], out_dir=out, tree=tree,
                   timeout=1800)
    every = run.metrics()
    for r in every:  # a baseline before the scoring time was named timing/reward
        r.setdefault("timing/reward", r.get("reward/time_s", 0.0))
    med = {k: median(every, k, skip=WARMUP) for k in PHASES}  # no old_logprob: on-policy
    med["other"] = median(r["timing/step"] - sum(r.get(k, 0.0) for k in NAMED) for r in every[WARMUP:])
    # the command less its steps: start-up (imports, Ray, the roles) and end (save, stop, exit)
    med["start+end"] = run.wall_s - sum(r["timing/step"] for r in every)
    return med


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="23b9f50", help="a commit, or none")
    p.add_argument("--variant", action="append", default=[], help="NAME:key=value,key=value (this checkout)")
    p.add_argument("--ours", nargs="*", default=[], help="overrides for every run")
    p.add_argument("--config", default="quickstart", help="e.g. quickstart_async")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, checkouts(args.baseline, tmp) as trees:
        runs = [(name, tree, []) for name, tree in trees]
        runs += [(name, HERE, overrides.split(",")) for name, _, overrides in (v.partition(":") for v in args.variant)]
        rows = []
        for r in range(args.rounds):
            for name, tree, overrides in runs:
                out = os.path.join(tmp, f"run{r}-{len(rows)}")
                rows.append((f"{name}, {r + 1}", _run(tree, out, args.steps, args.ours + overrides, args.config)))
    print(f"\n{args.config} step time, median of steps 3..{args.steps} (s); every run: {' '.join(args.ours) or '-'}")
    cols = (*PHASES, "other", "start+end")
    print("| run | " + " | ".join(cols) + " |\n|" + "---|" * (len(cols) + 1))
    for name, med in rows:
        print(f"| {name} | " + " | ".join(f"{med[k]:.3f}" for k in cols) + " |")
    rows_out = [[name, *(round(v, 3) if v else "-" for v in (
        med["timing/step"], med["timing/gen"] + med["timing/trainer_wait"], med["timing/reward"],
        med["timing/old_logprob"], med["timing/update"], med["timing/sync"] + med["timing/sync_wait"], med["other"],
        med["driver/cpu_s"]))] for name, med in rows]
    write("quickstart_step_time", title="Quickstart step time by phase",
          measures="The quickstart's step by phase (`timing/*`, median over steps 3..), the driver's CPU, for this "
                   "checkout against an earlier commit (a git worktree) or other settings of itself, alternated.",
          tables=[Table("phases", f"{args.config}'s step by phase (s), {args.rounds} rounds x {args.steps} steps, median of "
                        f"steps {WARMUP + 1}-{args.steps}; every run: {' '.join(args.ours) or '-'}",
                        ["run", "step", "generation", "of it scoring", "old log-probs", "update", "sync", "rest",
                         "driver CPU"], rows_out,
                        "generation: timing/gen + timing/trainer_wait; sync: timing/sync + timing/sync_wait")],
          extra={"medians": dict(rows)})


if __name__ == "__main__":
    main()
