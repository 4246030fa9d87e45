"""The tiny bundles' bytes on this CPU and on a smaller one, with the kernels pinned and not.

    python bench/assets_compare.py [--bundles text tools vl] [--warmup-steps N]

`python -m dapo_megatron.assets compare`'s builds (assets/compare.py), kept as a results file for
the docs: each bundle built four times, each in a process of its own (pinned / native kernels, this
machine as it is / told it is a smaller CPU), with the sha256 of each build, its seconds, the files
each pair differs in, and, at the whole recipe, whether the pinned build is the recorded one.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from results import Table, write

from dapo_megatron.assets import compare


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundles", nargs="+", choices=compare.BUNDLES, default=list(compare.BUNDLES))
    p.add_argument("--warmup-steps", type=int, default=None, help="a prefix of each warm-up (default: the whole)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = compare.compare(args.bundles, work=Path(tmp), warmup_steps=args.warmup_steps)
    rows = []
    for bundle, row in results.items():
        for setting, built in row["settings"].items():
            mode = compare.SETTINGS[setting][0]
            files = row[f"{mode}_differs_in"]
            recorded = ""
            if mode == "pinned" and "pinned_is_recorded" in row:
                recorded = "yes" if built["sha256"] == row["recorded_sha256"] else "NO"
            rows.append([bundle, setting, built["sha256"][:16], f"{built['seconds']:.0f}", compare.pair_text(files),
                         recorded])
    steps = "each recipe's whole warm-up" if args.warmup_steps is None else f"{args.warmup_steps} warm-up steps"
    pinned_same = all(not row["pinned_differs_in"] for row in results.values())
    native_same = [b for b, row in results.items() if not row["native_differs_in"]]
    summary = (f"{', '.join(results)}, {steps}: pinned, {'the same files' if pinned_same else 'OTHER FILES'} on "
               f"this CPU and a smaller one; native, "
               + (f"the same in {', '.join(native_same)} only" if native_same else "other weights in every bundle"))
    write("assets_compare", title="The tiny bundles' bytes on a smaller CPU", summary=summary,
          measures="`python -m dapo_megatron.assets compare`: each bundle built four times, each in a process of its "
                   "own: with the kernels pinned (`assets/kernels.py`) and native, on this machine as it is and told "
                   "it is a smaller CPU (torch's portable kernels, oneDNN at SSE4.1, MKL at SSE4.2, glibc without "
                   "AVX / FMA); the sha256 of each build's files, its seconds, the files each pair differs in and "
                   "whether the pinned build is the recipe's recorded sha256.",
          tables=[Table("builds", f"The three bundles, {steps}, seed 0",
                        ["bundle", "kernels, CPU", "sha256 (first 16)", "seconds", "the pair (this CPU, smaller CPU)",
                         "the recorded sha256"], rows)],
          extra={"bundles": results, "warmup_steps": args.warmup_steps})


if __name__ == "__main__":
    main()
