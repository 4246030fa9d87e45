"""The command line of `python -m dapo_megatron.convert`: its parser, the error that bad input
raises, where the workers' library output goes. Standard library only, so that --help and a
usage error import neither torch nor Megatron.
"""
from __future__ import annotations

import argparse
import os


class UsageError(Exception):
    """Bad command line or input: reported as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dapo_megatron.convert", description="Convert checkpoints "
                                "between HF safetensors and Megatron-Core distributed checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron dist checkpoint")
    a.add_argument("--hf-dir", required=True)
    b = sub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors")
    b.add_argument("--ckpt", required=True)
    b.add_argument("--hf-config", default=None, help="HF dir with config.json (default: CKPT/hf)")
    b.add_argument("--shard-mb", type=int, default=4096, help="max size of one output file (MiB)")
    for s, verb in ((a, "write"), (b, "load")):
        s.add_argument("--out", required=True, help="output dir (written via a temp dir next to it)")
        for name, what in (("tp", "tensor"), ("pp", "pipeline"), ("ep", "expert"), ("etp", "expert-tensor")):
            s.add_argument(f"--{name}", type=int, default=1, help=f"{what} parallel degree to {verb} the "
                           "Megatron checkpoint at (any layout loads any other)")
        # dtypes.DTYPES's names, written out so that --help imports no torch (tests/unit/test_config.py)
        s.add_argument("--dtype", choices=["keep", "bf16", "fp32", "fp16"], default="keep",
                       help="dtype of the output (keep: that of the input)")
        s.add_argument("--force", action="store_true", help="overwrite an existing --out")
        s.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"], default="auto",
                       help="where the workers run (auto: one accelerator per rank if there are enough, else CPU)")
        s.add_argument("--timeout", type=float, default=3600.0, help="seconds before the workers are killed")
        s.add_argument("--verbose", action="store_true", help="print worker tracebacks on errors")
    return p


def log_path(args) -> str:
    """Where the workers' library output goes (Megatron's Apex / TE fallback warnings and the
    like): beside the output folder, so the console keeps our lines and the folder only its files."""
    return os.path.abspath(args.out).rstrip(os.sep) + ".convert.log"
