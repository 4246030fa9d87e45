"""Rollout engine numbers on a tiny model: start-up, generation tokens/s, weight-push time.

    python bench/rollout_throughput.py [--kind qwen3_moe] [--prompts 16] [--n 4] [--max-tokens 128]

Generation: `prompts` random prompts x `n` samples at temperature 1, response tokens per second
of wall time. Push: the whole model through `update_weights` (pause -> load -> post-process ->
reset prefix cache -> resume), handing tensors to the in-process worker vs safetensors bytes (the
transport for engines whose workers are other processes).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _push_rows(engine, path: str, repeats: int) -> list[tuple[str, str]]:
    from safetensors.torch import load_file
    items = sorted(load_file(f"{path}/model.safetensors").items())
    mb = sum(t.numel() * t.element_size() for _, t in items) / 2**20
    rows = []
    for transport in ("tensors", "bytes"):
        engine.weight_transport = transport
        sec = _timed(lambda: engine.update_weights([items]), repeats)
        rows.append((f"weight push, {transport} ({mb:.1f} MB, {len(items)} tensors)",
                     f"{sec * 1e3:.1f} ms ({mb / 1024 / sec:.2f} GB/s)"))
    engine.weight_transport = "tensors"
    sec = _timed(engine.checksums, 1)
    rows.append((f"checksums, readback of all weights ({mb:.1f} MB)", f"{sec * 1e3:.1f} ms"))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", default="qwen3_moe")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--push-repeats", type=int, default=5)
    p.add_argument("--push-hidden", type=int, default=1024, help="hidden size of the wider push model; 0: skip")
    args = p.parse_args()

    import os

    import torch

    from dapo_megatron.assets.models import build_tiny_model
    from dapo_megatron.config.schema import RolloutConfig
    from dapo_megatron.device import get_device
    os.environ.update(get_device("auto").vllm_env())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(args.kind, f"{tmp}/m", vocab_size=1024, seed=0)
        t0 = time.perf_counter()
        import vllm.v1.engine.llm_engine  # noqa: F401  (timed apart from the engine start)
        from dapo_megatron.batch import Prompt
        from dapo_megatron.rollout.engine import Engine
        from dapo_megatron.rollout.types import Sampling
        rows.append(("import vllm + engine module", f"{time.perf_counter() - t0:.1f} s"))
        engine = Engine(path, RolloutConfig(enforce_eager=True), dtype=args.dtype,
                        max_model_len=args.prompt_len + args.max_tokens + 8)
        rows.append(("engine start-up (in-process)", f"{engine.startup_s:.1f} s"))

        g = torch.Generator().manual_seed(0)
        prompts = [Prompt(tuple(p)) for p in torch.randint(0, 1024, (args.prompts, args.prompt_len), generator=g).tolist()]
        sampling = Sampling(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)
        engine.generate(prompts[:2], Sampling(max_tokens=8))  # warm-up
        t0 = time.perf_counter()
        groups = engine.generate(prompts, sampling)
        dt = time.perf_counter() - t0
        tokens = sum(len(r) for grp in groups for r in grp.responses)
        rows.append((f"generate {args.prompts} prompts x n={args.n} x {args.max_tokens} tok",
                     f"{tokens / dt:,.0f} tok/s ({tokens} tok, {dt:.2f} s)"))

        rows += _push_rows(engine, path, args.push_repeats)
        engine.shutdown()
        if args.push_hidden:  # a wider model, so that per-byte costs show
            kw = dict(hidden_size=args.push_hidden, moe_intermediate_size=args.push_hidden // 2,
                      intermediate_size=2 * args.push_hidden, num_experts=16)
            path = build_tiny_model(args.kind, f"{tmp}/wide", vocab_size=1024, seed=0, **kw)
            engine = Engine(path, RolloutConfig(enforce_eager=True), dtype=args.dtype, max_model_len=64)
            rows += _push_rows(engine, path, max(1, args.push_repeats // 2))
            engine.shutdown()

    width = max(len(r[0]) for r in rows)
    print(f"\nrollout engine, {args.kind} tiny, {args.dtype}, device {get_device('auto').kind}")
    for name, value in rows:
        print(f"| {name:<{width}} | {value} |")


if __name__ == "__main__":  # vLLM may spawn processes: the guard keeps them from re-running this
    main()
