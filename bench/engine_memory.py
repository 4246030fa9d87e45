"""A rollout engine's heap over many rounds: oneDNN's global kernel cache, glibc's free pages.

    python bench/engine_memory.py [--rounds 120] [--every 20] [--settings default,keep-pages,onednn-cache,mmap-1m,handlers-1024]

One quickstart-sized vLLM-CPU engine, in-process, alone: each round generates 24 prompts of
20-64 random tokens x n=8 (16 tokens each) and then pushes the same weights back, as a step
does. Every new token count makes vLLM-CPU build a oneDNN matmul kernel per layer; its
handlers keep 32 a layer, and oneDNN's own global cache up to 1024 more. The CPU device turns
that global cache off (`ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`), and the engine hands glibc's free
heap pages back after every weight update (`Device.release_host_memory`): `default`.
`keep-pages` skips the hand-back; `onednn-cache` skips it too and restores oneDNN's default
cache (1024), i.e. the engine before either. `mmap-1m` is `default` with glibc's thresholds fixed
in the child's environment (every block of 1 MB or more that the heap's free space cannot serve
gets its own mapping, returned on free; the heap's top trimmed only by the hand-back): a flatter
free heap, tried and left out (docs/reports/data-plane-memory-investigation.md). `handlers-1024` is `default` with vLLM-CPU's
per-layer handlers keeping 1024 kernels instead of 32 (none evicted and rebuilt as token counts
come and go): tried and left out, its kernels are the growth. Each setting runs in a fresh
process, one after the other; prints RSS, glibc's in-use / free bytes (mallinfo2), the mean generate time and
the hand-back's time of each `--every` rounds. glibc's in-use bytes at a round's end include the
round's last finished requests (up to ~90 here, ~10 kB each with their generators), which vLLM
frees at its next step: they move it by ~1 MB from round to round without a trend.
What stays allocated after many rounds, by call site: `heaptrack python bench/engine_memory.py
--child default --rounds 80 --live-at-exit` against the same with `--rounds 20`
(`heaptrack_print -f ... -d ...`, or `--flamegraph-cost-type leaked -F` of each, compared).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time

from results import Table, write

# setting -> (ONEDNN_PRIMITIVE_CACHE_CAPACITY, free heap pages handed back after each update,
# the child's glibc environment: read once, at its start)
_FIXED_THRESHOLDS = {"MALLOC_MMAP_THRESHOLD_": str(2**20), "MALLOC_TRIM_THRESHOLD_": str(2**28)}
SETTINGS = {"default": ("0", True, {}), "keep-pages": ("0", False, {}), "onednn-cache": ("1024", False, {}),
            "mmap-1m": ("0", True, _FIXED_THRESHOLDS), "handlers-1024": ("0", True, {})}
HANDLER_KERNELS = {"handlers-1024": 1024}  # kernels kept by each layer's handler, where not vLLM's 32


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _child(rounds: int, every: int, capacity: str, release: bool, live_at_exit: bool = False,
           handler_kernels: int = 0) -> None:
    """Run the engine; one JSON line per `every` rounds. live_at_exit: end with os._exit right after
    the last round, freeing nothing, so that a heap profiler's "leaked" is what the rounds left live."""
    import psutil
    import torch
    from safetensors.torch import load_file

    from dapo_megatron.assets.models import build_tiny_model
    from dapo_megatron.batch import Prompt
    from dapo_megatron.config.schema import RolloutConfig
    from dapo_megatron.device import Device
    from dapo_megatron.rollout.engine import Engine
    from dapo_megatron.rollout.engine_spec import EngineSpec
    from dapo_megatron.rollout.types import Sampling
    cpu_env = Device.vllm_env  # the engine applies the device's environment at start: `onednn-cache` overrides it
    Device.vllm_env = lambda self, tp=1: {**cpu_env(self, tp), "ONEDNN_PRIMITIVE_CACHE_CAPACITY": capacity}
    if handler_kernels:  # vLLM-CPU builds each layer's handler with 32 (model_executor/layers/utils.py)
        from vllm import _custom_ops as ops
        create = ops.create_onednn_mm
        ops.create_onednn_mm = lambda weight, primitive_cache_size=128: create(weight, handler_kernels)
    release_s = [0.0]
    def timed_release(_release=Device.release_host_memory):
        t0 = time.perf_counter()
        if release:
            _release()
        release_s[0] += time.perf_counter() - t0
    Device.release_host_memory = staticmethod(timed_release)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    path = build_tiny_model("qwen3_moe", f"{tempfile.mkdtemp()}/m", vocab_size=1024, seed=0)
    engine = Engine(EngineSpec.from_model(path, RolloutConfig(enforce_eager=True, max_num_batched_tokens=4096),
                                          dtype="fp32", max_model_len=96), device="cpu")
    weights = sorted(load_file(f"{path}/model.safetensors").items())
    g = torch.Generator().manual_seed(0)
    gen_s = 0.0
    for r in range(1, rounds + 1):
        lengths = torch.randint(20, 64, (24,), generator=g).tolist()
        prompts = [Prompt(tuple(torch.randint(0, 1024, (n,), generator=g).tolist())) for n in lengths]
        t0 = time.perf_counter()
        engine.generate(prompts, Sampling(n=8, temperature=1.0, max_tokens=16, seed=r))
        gen_s += time.perf_counter() - t0
        engine.update_weights([weights])
        if r % every == 0:
            m = libc.mallinfo2()
            print(json.dumps({"round": r, "rss": psutil.Process().memory_info().rss / 2**20, "in_use": m.uordblks / 2**20,
                              "free": m.fordblks / 2**20, "generate_s": gen_s / every,
                              "release_ms": 1e3 * release_s[0] / every}), flush=True)
            gen_s, release_s[0] = 0.0, 0.0
    if live_at_exit:
        sys.stdout.flush()
        os._exit(0)
    engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=120)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"comma-separated runs, in order, each one of: {', '.join(SETTINGS)} (repeats allowed)")
    ap.add_argument("--child", default="", help="run this one setting in this process: its JSON lines, no table "
                    "(mmap-1m's environment is then yours to set)")
    ap.add_argument("--live-at-exit", action="store_true",
                    help="with --child: exit right after the last round, freeing nothing (for heaptrack)")
    args = ap.parse_args()
    if args.child:
        capacity, release, _ = SETTINGS[args.child]
        return _child(args.rounds, args.every, capacity, release, args.live_at_exit,
                      HANDLER_KERNELS.get(args.child, 0))
    rows = []
    order = args.settings.split(",")
    for i, setting in enumerate(order):
        if setting not in SETTINGS:
            raise SystemExit(f"--settings: {setting!r} is not one of {', '.join(SETTINGS)}")
        out = subprocess.run([sys.executable, __file__, "--child", setting, "--rounds", str(args.rounds),
                              "--every", str(args.every)], capture_output=True, text=True,
                             env={**os.environ, **SETTINGS[setting][2]})
        lines = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
        if out.returncode != 0 or not lines:
            raise SystemExit(f"the {setting} run failed:\n{out.stderr[-3000:]}")
        # a setting named more than once (alternated runs, for timing) gets its run's number
        rows += [(f"{setting} ({i + 1})" if order.count(setting) > 1 else setting, line) for line in lines]
    print(f"\nOne engine alone, {args.rounds} rounds of 24 prompts x 8 + a weight push")
    print("| setting | round | RSS (MB) | glibc in use (MB) | glibc free (MB) | generate (s / round) | hand-back (ms) |")
    print("|---|---|---|---|---|---|---|")
    for setting, r in rows:
        print(f"| {setting} | {r['round']} | {r['rss']:.1f} | {r['in_use']:.1f} | {r['free']:.1f} "
              f"| {r['generate_s']:.3f} | {r['release_ms']:.2f} |")
    table = []
    for setting in dict.fromkeys(s for s, _ in rows):
        mine = [r for s, r in rows if s == setting]
        first, last = mine[0], mine[-1]
        print(f"{setting}: from round {first['round']} to {last['round']} RSS {last['rss'] - first['rss']:+.1f} MB, "
              f"in use {last['in_use'] - first['in_use']:+.1f} MB; generate "
              f"{sum(r['generate_s'] for r in mine) / len(mine):.3f} s a round")
        table.append([setting, f"{last['rss'] - first['rss']:+.1f}", f"{last['in_use'] - first['in_use']:+.1f}",
                      f"{sum(r['generate_s'] for r in mine) / len(mine):.3f}"])
    span = f"round {rows[0][1]['round']} -> {rows[-1][1]['round']}"
    write("engine_memory", title="A rollout engine's heap over many rounds",
          measures="One quickstart-sized vLLM-CPU engine, in-process, alone, each setting in a fresh process: each round "
                   "generates 24 prompts x 8 and pushes the weights back; its RSS and glibc's in-use bytes round by round.",
          tables=[Table("settings", f"{args.rounds} rounds a setting, one after the other: growth over the rounds and "
                        "the mean generate time", ["setting (run)", f"RSS, {span} (MB)", f"glibc in use, {span} (MB)",
                                                   "generate (s a round)"], table)],
          extra={"rounds": [{"setting": s, **r} for s, r in rows]})


if __name__ == "__main__":
    main()
