"""`python -m dapo_megatron.assets build --out DIR [--seed S] [--warmup-steps N] [--force]`."""
from __future__ import annotations

import argparse
import json

from dapo_megatron.assets.build import (DEFAULT_SEED, DEFAULT_WARMUP_STEPS, build_assets, default_asset_dir,
                                        read_manifest)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dapo_megatron.assets",
                                     description="Build the offline tiny tokenizer, models and task data.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build (or reuse) an asset dir")
    build.add_argument("--out", default=str(default_asset_dir()),
                       help="asset dir (default: $DAPO_MEGATRON_ASSETS or ~/.cache/dapo-megatron/tiny-v1)")
    build.add_argument("--seed", type=int, default=DEFAULT_SEED)
    build.add_argument("--warmup-steps", type=int, default=DEFAULT_WARMUP_STEPS,
                       help="at most this many supervised warm-up steps per model; it stops early at the "
                            "target sampled accuracy (0: random init)")
    build.add_argument("--force", action="store_true", help="rebuild even if DIR holds a build")
    args = parser.parse_args(argv)
    out = build_assets(args.out, seed=args.seed, warmup_steps=args.warmup_steps, force=args.force)
    print(json.dumps(read_manifest(out)["models"], indent=2))


if __name__ == "__main__":
    main()
