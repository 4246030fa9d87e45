"""`python -m dapo_megatron.assets build [--bundle text|tools|vl] [--out DIR] [--seed S]
[--warmup-steps N] [--force]`: build (or reuse) one of the tiny bundles that tiny:// names."""
from __future__ import annotations

import argparse
import json

from dapo_megatron.assets.build import (DEFAULT_SEED, DEFAULT_WARMUP_STEPS, build_assets, build_tool_assets,
                                        build_vl_task_assets, default_asset_dir, read_manifest, tool_asset_dir,
                                        vl_asset_dir)

# bundle -> (its default dir, what tiny:// names it serves)
BUNDLES = {"text": (default_asset_dir, "tiny://tokenizer, qwen2, qwen3_moe, data/..."),
           "tools": (tool_asset_dir, "tiny://tools/..."),
           "vl": (vl_asset_dir, "tiny://qwen3_vl_moe, tiny://geo3k/...")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dapo_megatron.assets",
                                     description="Build the offline tiny tokenizer, models and task data.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build (or reuse) an asset dir")
    build.add_argument("--bundle", choices=sorted(BUNDLES), default="text",
                       help="; ".join(f"{name}: {names}" for name, (_, names) in BUNDLES.items()))
    build.add_argument("--out", default=None,
                       help="asset dir (default: where tiny:// looks: $DAPO_MEGATRON_ASSETS or "
                            "~/.cache/dapo-megatron/tiny-v1, with -tools / -vl appended for those bundles)")
    build.add_argument("--seed", type=int, default=DEFAULT_SEED)
    build.add_argument("--warmup-steps", type=int, default=None,
                       help=f"at most this many supervised warm-up steps per model; it stops early at the "
                            f"target sampled accuracy (0: random init; default: text {DEFAULT_WARMUP_STEPS}, "
                            f"vl its own; the tools bundle has a fixed recipe)")
    build.add_argument("--force", action="store_true", help="rebuild even if DIR holds a build")
    args = parser.parse_args(argv)
    out = args.out or str(BUNDLES[args.bundle][0]())
    if args.bundle == "tools":
        if args.warmup_steps is not None:
            parser.error("--warmup-steps: the tools bundle has a fixed warm-up recipe")
        out = build_tool_assets(out, seed=args.seed, force=args.force)
    elif args.bundle == "vl":
        out = build_vl_task_assets(out, seed=args.seed, warmup_steps=args.warmup_steps, force=args.force)
    else:
        steps = DEFAULT_WARMUP_STEPS if args.warmup_steps is None else args.warmup_steps
        out = build_assets(out, seed=args.seed, warmup_steps=steps, force=args.force)
    print(json.dumps(read_manifest(out)["models"], indent=2))


if __name__ == "__main__":
    main()
