"""Does each policy loss learn the quickstart task? Reward of the first and last third of a run.

    python bench/policy_losses.py [--losses dapo,gspo,cispo] [--seeds 1,2,3] [--steps 20] [key=value ...]

Extra key=value overrides go to every run, e.g. actor.ppo_mini_batch_size=8: two optimizer steps a
step, so the second mini-batch is off-policy (ratios != 1). With one mini-batch a step every ratio is
1 and CISPO's gradient is DAPO's exactly (the same run, bit for bit).

Runs `python -m dapo_megatron.main --config-name quickstart` per (loss, seed), one after the other
(gspo with actor.loss_agg_mode=seq-mean-token-mean, the aggregation it is defined with), the seed
set for the data order, the engine's sampling and Megatron's init (trainer / rollout / data.seed).
Prints per loss: the mean reward over the first and the last third of the steps, each seed's gain
(last - first third), their mean and their spread (max - min over seeds).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from common import run_main
from results import Table, write

EXTRA = {"gspo": ["actor.loss_agg_mode=seq-mean-token-mean"]}


def run(loss: str, seed: int, steps: int, root: str, extra: list[str]) -> list[float]:
    overrides = [f"actor.policy_loss={loss}", *EXTRA.get(loss, []), f"trainer.total_training_steps={steps}",
                 f"trainer.seed={seed}", f"rollout.seed={seed}", f"data.seed={seed}", "trainer.test_freq=0",
                 "trainer.val_before_train=false", "trainer.save_freq=-1", *extra]
    return [r["reward/mean"] for r in run_main("quickstart", overrides, out_dir=os.path.join(root, f"{loss}-{seed}")).metrics()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--losses", default="dapo,gspo,cispo")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("overrides", nargs="*", help="key=value for every run")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    root = tempfile.mkdtemp(prefix="policy-losses-")
    print(f"overrides: {' '.join(args.overrides) or 'none'}")
    print(f"| loss | first third | last third | gain per seed ({', '.join(map(str, seeds))}) | mean gain | spread |")
    print("|---|---|---|---|---|---|")
    rows = []
    for loss in args.losses.split(","):
        firsts, lasts = [], []
        for seed in seeds:
            rewards = run(loss, seed, args.steps, root, args.overrides)
            third = max(1, len(rewards) // 3)
            firsts.append(statistics.mean(rewards[:third]))
            lasts.append(statistics.mean(rewards[-third:]))
        gains = [b - a for a, b in zip(firsts, lasts)]
        print(f"| {loss} | {statistics.mean(firsts):.3f} | {statistics.mean(lasts):.3f} | "
              f"{', '.join(f'{g:+.3f}' for g in gains)} | {statistics.mean(gains):+.3f} | "
              f"{max(gains) - min(gains):.3f} |", flush=True)
        rows.append([loss, round(statistics.mean(firsts), 3), round(statistics.mean(lasts), 3),
                     ", ".join(f"{g:+.3f}" for g in gains), f"{statistics.mean(gains):+.3f}", f"{max(gains) - min(gains):.3f}"])
    write("policy_losses", title="Policy losses on the quickstart task",
          measures="The reward of the first vs the last third of a quickstart run per policy loss and seed, one run "
                   "after another: each seed's gain (last - first third), their mean and spread.",
          tables=[Table("gains", f"Reward per policy loss, {args.steps} steps, seeds {args.seeds}; overrides: "
                        f"{' '.join(args.overrides) or 'none'}",
                        ["actor.policy_loss", "first third", "last third", f"gain per seed ({', '.join(map(str, seeds))})",
                         "mean gain", "spread"], rows)])


if __name__ == "__main__":
    main()
