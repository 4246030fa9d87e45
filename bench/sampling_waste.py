"""Generated vs kept tokens and time per step: dynamic sampling `sync` vs `early_stop`, same run.

Runs the quickstart (warm-started tiny MoE, real engine, math reward) for a few steps in each
mode and prints a table from the runs' metrics.jsonl. Waste = tokens generated but not trained
on, split into "filtered" (groups the DAPO filter drops: a property of the task and policy, the
same in both modes) and "overgen" (the surplus past train_batch_size and aborted responses: what
the scheduling mode controls).

    python bench/sampling_waste.py [--steps 8] [overrides ...]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import read_metrics
from results import Table, write

MODES = ("sync", "early_stop")


def run_mode(mode: str, steps: int, out: Path, extra: list[str]) -> list[dict]:
    import ray

    from dapo_megatron.config import load_config
    from dapo_megatron.driver.supervisor import run
    cfg = load_config("quickstart", [f"algorithm.filter_groups.mode={mode}", f"trainer.total_training_steps={steps}",
                                     f"trainer.default_local_dir={out}", "trainer.val_before_train=false",
                                     "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[jsonl]", *extra])
    try:
        run(cfg)
    finally:
        ray.shutdown()
    return read_metrics(str(out))


def summarize(rows: list[dict]) -> dict:
    rows = rows[1:] or rows  # the first step includes engine warm-up
    total = lambda k: sum(r.get(k, 0.0) for r in rows)  # noqa: E731
    gen, kept = total("sampling/generated_tokens"), total("sampling/kept_tokens")
    return {"steps": len(rows), "generated": gen, "kept": kept, "waste": 1 - kept / max(gen, 1),
            "filtered": total("sampling/filtered_tokens") / max(gen, 1),
            "over": total("sampling/overgenerated_tokens") / max(gen, 1),
            "aborted": total("sampling/aborted_tokens"), "gen_s": total("timing/gen") / len(rows),
            "step_s": total("timing/step") / len(rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            results[mode] = summarize(run_mode(mode, args.steps, Path(tmp) / mode, args.overrides))
    print(f"\n{'mode':<11} {'steps':>5} {'generated tok':>13} {'kept tok':>9} {'wasted':>7} {'filtered':>8} "
          f"{'overgen':>7} {'aborted tok':>11} {'gen s/step':>10} {'step s':>7}")
    for mode, r in results.items():
        print(f"{mode:<11} {r['steps']:>5} {r['generated']:>13.0f} {r['kept']:>9.0f} {r['waste']:>7.1%} "
              f"{r['filtered']:>8.1%} {r['over']:>7.1%} {r['aborted']:>11.0f} {r['gen_s']:>10.2f} {r['step_s']:>7.2f}")
    s, e = results["sync"], results["early_stop"]
    print(f"early_stop / sync: generated tokens {e['generated'] / max(s['generated'], 1):.2f}x, "
          f"gen time {e['gen_s'] / max(s['gen_s'], 1e-9):.2f}x (target: early_stop over-generation <= 10%; 'filtered' is DAPO's own filter)")
    write("sampling_waste", title="Dynamic sampling: sync rounds against early stop",
          summary=f"early_stop generates {e['generated'] / max(s['generated'], 1):.2f}x the tokens of sync, gen time "
                  f"{e['gen_s'] / max(s['gen_s'], 1e-9):.2f}x; over-generation {e['over']:.1%} (sync {s['over']:.1%}) "
                  "besides DAPO's own filtering",
          measures="Generated vs kept tokens and the generation time per step of the quickstart in "
                   "`algorithm.filter_groups.mode=sync` and `early_stop`, one after the other (real engine, math "
                   "reward, the first step left out). Waste is split into the groups DAPO's filter drops (the same "
                   "in both modes) and over-generation (the surplus past `data.train_batch_size` and aborted "
                   "responses: what the mode controls).",
          tables=[Table("modes", f"sync against early_stop on the quickstart, {args.steps} steps each (the first left "
                        f"out), relative to sync; overrides: {' '.join(args.overrides) or 'none'}",
                        ["algorithm.filter_groups.mode", "generated tokens (x sync)", "generation time (x sync)",
                         "over-generation (share of generated tokens)"],
                        [[mode, f"{r['generated'] / max(s['generated'], 1):.2f}x", f"{r['gen_s'] / max(s['gen_s'], 1e-9):.2f}x",
                          f"{r['over']:.1%}"] for mode, r in results.items()],
                        note="Over-generation is besides DAPO's own filtering; the script's target for early_stop "
                             "is at most 10%. One run of each mode, one after the other: the generation time ratio "
                             "is as noisy as the machine.")],
          extra={"modes": results})


if __name__ == "__main__":
    main()
