"""Does the VL demo learn by more than its seed-to-seed spread? `quickstart_vl` over several seeds.

    python bench/vl_seeds.py [--seeds 1 2 3] [key=value ...]

Runs `python -m dapo_megatron.main --config-name quickstart_vl` once per seed (data order,
sampling and Megatron's seeds: `data.seed`, `rollout.seed`, `trainer.seed`), as shipped plus any
overrides, one after the other, and prints per seed: the wall time, the sampled accuracy of every
response generated (`acc/mean`) by fifths of the steps, the greedy val accuracy (`val/acc`) at each
validation; then the mean and spread (standard deviation over seeds) and issue #41's criteria:
every seed's last greedy val >= its step-0 val + 0.05, and the last fifth's sampled accuracy above
the first fifth's by more than twice the seed spread (the larger of the two fifths' spreads).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from common import run_main
from results import Table, write

VAL_GAIN = 0.05


def run_seed(seed: int, overrides: list[str], out: str) -> dict:
    run = run_main("quickstart_vl", [f"data.seed={seed}", f"rollout.seed={seed}", f"trainer.seed={seed}",
                                     "trainer.logger=[jsonl]", "trainer.resume_mode=disable", *overrides],
                   out_dir=out, timeout=3600)
    rows = run.metrics()
    acc = [r["acc/mean"] for r in rows if "acc/mean" in r]
    fifth = max(1, len(acc) // 5)
    return {"seed": seed, "wall_s": run.wall_s, "steps": len(acc),
            "fifths": [statistics.mean(acc[i * fifth:(i + 1) * fifth]) for i in range(5)],
            "val": [(r["step"], r["val/acc"]) for r in rows if "val/acc" in r]}


def spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            runs.append(run_seed(seed, args.overrides, os.path.join(tmp, f"seed{seed}")))
            print(json.dumps(runs[-1]), flush=True)
    val_steps = [step for step, _ in runs[0]["val"]]
    print(f"\nquickstart_vl over seeds {args.seeds}; overrides: {' '.join(args.overrides) or 'none'}")
    print("| seed | wall s | sampled accuracy by fifths of the steps | greedy val at steps "
          + " / ".join(map(str, val_steps)) + " | val gain | fifth 5 - fifth 1 |\n|---|---|---|---|---|---|")
    for r in runs:
        vals = [v for _, v in r["val"]]
        print(f"| {r['seed']} | {r['wall_s']:.0f} | " + " ".join(f"{a:.3f}" for a in r["fifths"])
              + " | " + " / ".join(f"{v:.3f}" for v in vals)
              + f" | {vals[-1] - vals[0]:+.3f} | {r['fifths'][-1] - r['fifths'][0]:+.3f} |")
    first = [r["fifths"][0] for r in runs]
    last = [r["fifths"][-1] for r in runs]
    fifths_mean = [statistics.mean(r["fifths"][i] for r in runs) for i in range(5)]
    fifths_sd = [spread([r["fifths"][i] for r in runs]) for i in range(5)]
    print("| mean (spread) | - | " + " ".join(f"{m:.3f} ({s:.3f})" for m, s in zip(fifths_mean, fifths_sd)) + " | "
          + " / ".join(f"{statistics.mean(r['val'][i][1] for r in runs):.3f}" for i in range(len(val_steps)))
          + " | | |")
    gain = statistics.mean(last) - statistics.mean(first)
    seed_spread = max(spread(first), spread(last))
    val_ok = all(r["val"][-1][1] >= r["val"][0][1] + VAL_GAIN for r in runs)
    table = [[str(r["seed"]), " ".join(f"{a:.3f}" for a in r["fifths"]), " / ".join(f"{v:.3f}" for _, v in r["val"]),
              f"{r['val'][-1][1] - r['val'][0][1]:+.3f}", f"{r['fifths'][-1] - r['fifths'][0]:+.3f}"] for r in runs]
    table.append(["mean (spread)", " ".join(f"{m:.3f} ({s:.3f})" for m, s in zip(fifths_mean, fifths_sd)),
                  " / ".join(f"{statistics.mean(r['val'][i][1] for r in runs):.3f}" for i in range(len(val_steps))), "", ""])
    write("vl_seeds", title="The VL demo over seeds",
          measures="`quickstart_vl` once per seed (`data.seed`, `rollout.seed`, `trainer.seed`), one run after the "
                   "other: the sampled accuracy by fifths of the steps, the greedy val accuracy at each validation.",
          tables=[Table("seeds", f"quickstart_vl, {runs[0]['steps']} steps, one run per seed; overrides: "
                        f"{' '.join(args.overrides) or 'none'}",
                        ["seed", f"sampled accuracy by fifths of the {runs[0]['steps']} steps",
                         "greedy val at steps " + " / ".join(map(str, val_steps)), "val gain", "last - first fifth"],
                        table)],
          extra={"runs": runs})
    print(f"\nevery seed's greedy val gains >= {VAL_GAIN}: {'yes' if val_ok else 'NO'}; sampled accuracy, last fifth "
          f"- first fifth {gain:+.3f} vs twice the seed spread {2 * seed_spread:.3f}: "
          f"{'yes' if gain > 2 * seed_spread else 'NO'}")


if __name__ == "__main__":
    main()
