"""`python -m dapo_megatron.plan [--config-name X] [key=value ...]`: will this layout fit?

Prints the memory plan of a config per device (no device, no Ray, no download): the actor's
parameters, grads and optimizer state, activations and logits, the reference, the engine's
share, and the peak of each phase against the device's memory. The model's shape comes from
model.path's config.json, or for the shipped 30B configs from configs/hf/<model dir>.json.
Exits 1 when the plan does not fit, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from dapo_megatron.config import ConfigError, load_config, num_engines
from dapo_megatron.models.spec import ModelSpec
from dapo_megatron.plan import check, device_bytes, make_plan, max_response_length, render
from dapo_megatron.plan.build import build_ranks, render_row
from dapo_megatron.plan.coverage import Coverage, MetaCheckpoint, tensor_list

SHIPPED_SHAPES = Path(__file__).resolve().parents[2] / "configs" / "hf"


def model_spec(cfg, hf_config: str = ""):
    """The ModelSpec of `--hf-config`, else of model.path, else of the shipped shape of a model
    dir of that name (configs/hf/): the plan needs only the shape."""
    if hf_config:
        path = Path(hf_config)
        path = path / "config.json" if path.is_dir() else path
        return ModelSpec.from_hf(json.loads(path.read_text()))
    path = cfg.model.path
    if path.startswith("tiny://"):  # the assets' builders (transformers, tokenizers): only for tiny://
        from dapo_megatron.assets import resolve_asset_path
        path = resolve_asset_path(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelSpec.from_pretrained(path)
    shipped = SHIPPED_SHAPES / f"{os.path.basename(os.path.normpath(path))}.json"
    if shipped.is_file():
        return ModelSpec.from_hf(json.loads(shipped.read_text()))
    raise ConfigError("model.path", f"model.path {path} has no config.json and configs/hf/ has no {shipped.name}: "
                                    "pass --hf-config path/to/config.json")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dapo_megatron.plan", description=__doc__.splitlines()[0])
    p.add_argument("--config-name", "-cn", default="dapo")
    p.add_argument("--hf-config", default="", help="the model's config.json (default: model.path's)")
    p.add_argument("--device-memory-gb", type=float, default=0.0,
                   help="one device's memory (default: trainer.device_memory_gb, else the device's)")
    p.add_argument("--max-response", action="store_true", help="also print the largest max_response_length that fits")
    p.add_argument("--build", action="store_true",
                   help="build every distinct actor rank at the real shape on the meta device (Megatron-Core, torch's "
                        "fake process group) and check its state against the plan's, byte for byte; exit 1 if not equal")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config_name, args.overrides)
        spec = model_spec(cfg, args.hf_config)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.build:
        return _build(cfg, spec)
    memory, flash = device_bytes(cfg, args.device_memory_gb)
    plan = make_plan(cfg, spec, memory, flash=flash)
    print(render(plan))
    if args.max_response and memory:
        print(f"largest data.max_response_length that fits: {max_response_length(cfg, spec, memory, flash=flash)}")
    try:
        check(plan)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _build(cfg, spec) -> int:
    start = time.perf_counter()
    listed = tensor_list(cfg.model.path)
    coverage = listed and Coverage(MetaCheckpoint(listed), spec, cfg.rollout.sync.bucket_mb << 20)
    builds = build_ranks(cfg, spec, on_rank=lambda b: print(render_row(b), flush=True), coverage=coverage)
    bad = [b.rank for b in builds if not b.equal]
    print(f"{len(builds)} distinct ranks built in {time.perf_counter() - start:.1f} s: "
          + (f"ranks {bad} differ from the plan" if bad else "every one equal to the plan"))
    if not coverage:
        print(f"checkpoint and export: not checked, configs/hf/ lists no tensors of {cfg.model.path}")
        return 1 if bad else 0
    errors = coverage.check()
    for line in errors[:20]:
        print(f"error: {line}")
    print(f"{len(errors)} errors" if errors else coverage.summary(num_engines(cfg)))
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main())
