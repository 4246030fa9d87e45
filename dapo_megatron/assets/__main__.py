"""`python -m dapo_megatron.assets build [--bundle text|tools|vl] [--out DIR] [--seed S]
[--warmup-steps N] [--kernels pinned|native] [--force]`: build (or reuse) one of the tiny bundles
that tiny:// names. `python -m dapo_megatron.assets compare [--bundles ...] [--warmup-steps N]`:
build each bundle pinned and not, on this CPU and on a smaller one, and compare (assets/compare.py)."""
from __future__ import annotations

import argparse
import json
import sys

from dapo_megatron.assets import compare as compare_mod
from dapo_megatron.assets.build import (DEFAULT_SEED, DEFAULT_WARMUP_STEPS, build_assets, build_tool_assets,
                                        build_vl_task_assets, default_asset_dir, read_manifest, tool_asset_dir,
                                        vl_asset_dir)
from dapo_megatron.assets.kernels import KERNELS

# bundle -> (its default dir, what tiny:// names it serves)
BUNDLES = {"text": (default_asset_dir, "tiny://tokenizer, qwen2, qwen3_moe, data/..."),
           "tools": (tool_asset_dir, "tiny://tools/..."),
           "vl": (vl_asset_dir, "tiny://qwen3_vl_moe, tiny://geo3k/...")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dapo_megatron.assets",
                                     description="Build the offline tiny tokenizer, models and task data.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build (or reuse) an asset dir")
    build.add_argument("--bundle", choices=sorted(BUNDLES), default="text",
                       help="; ".join(f"{name}: {names}" for name, (_, names) in BUNDLES.items()))
    build.add_argument("--out", default=None,
                       help="asset dir (default: where tiny:// looks: $DAPO_MEGATRON_ASSETS or "
                            "~/.cache/dapo-megatron/tiny-v2, with -tools / -vl appended for those bundles)")
    build.add_argument("--seed", type=int, default=DEFAULT_SEED)
    build.add_argument("--warmup-steps", type=int, default=None,
                       help=f"at most this many supervised warm-up steps per model; text and tools stop early "
                            f"at their target sampled accuracy (0: random init; default: text "
                            f"{DEFAULT_WARMUP_STEPS}, tools and vl their own)")
    build.add_argument("--kernels", choices=KERNELS, default="pinned",
                       help="pinned (default): CPU kernels every x86-64 machine runs alike, the same bytes "
                            "everywhere; native: this CPU's own, faster, its bytes its own")
    build.add_argument("--force", action="store_true", help="rebuild even if DIR holds a build")
    compare = sub.add_parser("compare", help="build each bundle pinned and native, on this CPU and on a smaller "
                                             "one, and say which files differ (exit 1 if the pinned ones do)")
    compare.add_argument("--bundles", nargs="+", choices=sorted(BUNDLES), default=["text", "tools", "vl"])
    compare.add_argument("--seed", type=int, default=DEFAULT_SEED)
    compare.add_argument("--warmup-steps", type=int, default=None,
                         help="a prefix of each warm-up (default: each recipe's whole warm-up, ~2-5 min a build)")
    compare.add_argument("--work", default=None, help="where the builds go (default: a new temp dir)")
    compare.add_argument("--json", default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)
    if args.command == "compare":
        return compare_mod.main(args)
    out = args.out or str(BUNDLES[args.bundle][0]())
    common = dict(seed=args.seed, force=args.force, kernels=args.kernels)
    if args.bundle == "tools":
        out = build_tool_assets(out, warmup_steps=args.warmup_steps, **common)
    elif args.bundle == "vl":
        out = build_vl_task_assets(out, warmup_steps=args.warmup_steps, **common)
    else:
        steps = DEFAULT_WARMUP_STEPS if args.warmup_steps is None else args.warmup_steps
        out = build_assets(out, warmup_steps=steps, **common)
    print(json.dumps(read_manifest(out)["models"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
