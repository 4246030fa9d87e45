"""Does the VL demo learn by more than its seed-to-seed spread? `quickstart_vl` over several seeds.

    python bench/vl_seeds.py [--seeds 1 2 3] [key=value ...]

Runs `python -m dapo_megatron.main --config-name quickstart_vl` once per seed (data order,
sampling and Megatron's seeds: `data.seed`, `rollout.seed`, `trainer.seed`), as shipped plus any
overrides, one after the other, and prints per seed: the wall time, the sampled accuracy of every
response generated (`acc/mean`) by fifths of the steps, the greedy val accuracy (`val/acc`) at each
validation; then the mean and spread (standard deviation over seeds) and what "learns" means
(issue #74): the last greedy val minus step 0's, over the seeds, above twice its spread, and the
last fifth's sampled accuracy above the first fifth's by more than twice the seed spread (the
larger of the two fifths' spreads). Each run starts from the tiny VL bundle every machine builds
alike (pinned CPU kernels, assets/kernels.py); its sha256 is recorded beside the results.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from common import run_main
from results import Table, write


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
    val_gains = [r["val"][-1][1] - r["val"][0][1] for r in runs]
    val_ok = statistics.mean(val_gains) > 2 * spread(val_gains)
    walls = [r["wall_s"] for r in runs]
    criteria = {"val_gain_mean": round(statistics.mean(val_gains), 4), "val_gain_spread": round(spread(val_gains), 4),
                "val_gain_range": [round(min(val_gains), 4), round(max(val_gains), 4)], "val_learns": val_ok,
                "fifths_gain": round(gain, 4), "fifths_spread": round(seed_spread, 4),
                "sampled_learns": gain > 2 * seed_spread, "wall_s": [round(min(walls)), round(max(walls))]}
    table = [[str(r["seed"]), " ".join(f"{a:.3f}" for a in r["fifths"]), " / ".join(f"{v:.3f}" for _, v in r["val"]),
              f"{r['val'][-1][1] - r['val'][0][1]:+.3f}", f"{r['fifths'][-1] - r['fifths'][0]:+.3f}"] for r in runs]
    table.append(["mean (spread)", " ".join(f"{m:.3f} ({s:.3f})" for m, s in zip(fifths_mean, fifths_sd)),
                  " / ".join(f"{statistics.mean(r['val'][i][1] for r in runs):.3f}" for i in range(len(val_steps))), "", ""])
    bundle = bundle_identity()
    summary = (f"seeds {', '.join(str(r['seed']) for r in runs)}, {runs[0]['steps']} steps: greedy val "
               f"{runs[0]['val'][0][1]:.3f} -> " + " / ".join(f"{r['val'][-1][1]:.3f}" for r in runs)
               + f" ({'learns' if val_ok else 'does NOT learn'}); sampled accuracy first -> last fifth "
               f"{statistics.mean(first):.3f} -> {statistics.mean(last):.3f} "
               f"({'learns' if criteria['sampled_learns'] else 'does NOT learn'}); "
               f"{criteria['wall_s'][0]}-{criteria['wall_s'][1]} s a run")
    write("vl_seeds", title="The VL demo over seeds", summary=summary,
          measures="`quickstart_vl` once per seed (`data.seed`, `rollout.seed`, `trainer.seed`), one run after the "
                   "other: the sampled accuracy by fifths of the steps, the greedy val accuracy at each validation.",
          tables=[Table("seeds", f"quickstart_vl, {runs[0]['steps']} steps, one run per seed; overrides: "
                        f"{' '.join(args.overrides) or 'none'}",
                        ["seed", f"sampled accuracy by fifths of the {runs[0]['steps']} steps",
                         "greedy val at steps " + " / ".join(map(str, val_steps)), "val gain", "last - first fifth"],
                        table, note=_note(criteria, bundle))],
          extra={"runs": runs, "criteria": criteria, "bundle": bundle})
    print(f"\ngreedy val, last - step 0: {criteria['val_gain_mean']:+.3f} vs twice its spread "
          f"{2 * criteria['val_gain_spread']:.3f}: {'yes' if val_ok else 'NO'}; sampled accuracy, last fifth "
          f"- first fifth {gain:+.3f} vs twice the seed spread {2 * seed_spread:.3f}: "
          f"{'yes' if criteria['sampled_learns'] else 'NO'}")


def _note(c: dict, bundle: dict) -> str:
    val = "learns" if c["val_learns"] else "does NOT learn"
    sampled = "learns" if c["sampled_learns"] else "does NOT learn"
    low, high = c["val_gain_range"]
    return (f"Greedy validation, last minus step 0: {c['val_gain_mean']:+.3f} over the seeds ({low:+.3f} to "
            f"{high:+.3f}) against twice its spread {2 * c['val_gain_spread']:.3f}: {val}. Sampled accuracy, "
            f"last fifth minus first: {c['fifths_gain']:+.3f} against twice the seed spread "
            f"{2 * c['fifths_spread']:.3f}: {sampled}. Each run took {c['wall_s'][0]}-{c['wall_s'][1]} s, from the "
            f"bundle {bundle['asset_version']} ({bundle['kernels']} kernels, sha256 {(bundle['sha256'] or '?')[:16]}).")


def bundle_identity() -> dict:
    """The VL bundle the runs started from: its recipe version, kernels and sha256."""
    from dapo_megatron.assets.build import read_manifest, vl_asset_dir
    manifest = read_manifest(vl_asset_dir()) or {}
    return {"asset_version": manifest.get("asset_version"), "kernels": manifest.get("kernels"),
            "sha256": (manifest.get("checksum") or {}).get("sha256")}


if __name__ == "__main__":
    main()
