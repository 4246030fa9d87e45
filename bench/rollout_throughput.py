"""Rollout engine numbers on a tiny model: start-up, generation tokens/s, weight-push time.

    python bench/rollout_throughput.py [--kind qwen3_moe] [--prompts 16] [--n 4] [--max-tokens 128]

Generation: `prompts` random prompts x `n` samples at temperature 1, response tokens per second
of wall time. Push: the whole model through `update_weights` (pause -> load -> post-process ->
reset prefix cache -> resume), handing tensors to the in-process worker vs safetensors bytes (the
transport for engines whose workers are other processes).

    python bench/rollout_throughput.py --vl [--prompts 16] [--n 4] [--max-tokens 128]

--vl: the tiny VL bundle (assets.vl: Qwen3-VL-MoE, vision tower included) on prompts of one
geo3k_synth figure each (224x224: 196 image tokens) vs a Qwen3-MoE of the same text sizes on
random text prompts of the same expanded lengths, one engine after the other; images/s is prompts
(one image each) per second of wall time; the VL push moves every tensor, the tower's included.
"""
from __future__ import annotations

import argparse
import tempfile
import time

from common import median
from results import Table, write


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def _push_rows(engine, path: str, repeats: int, label: str = "", checksums: bool = True) -> list[tuple[str, str]]:
    from safetensors.torch import load_file
    items = sorted(load_file(f"{path}/model.safetensors").items())
    mb = sum(t.numel() * t.element_size() for _, t in items) / 2**20
    rows = []
    for transport in ("tensors", "bytes"):
        engine.weight_transport = transport
        sec = _timed(lambda: engine.update_weights([items]), repeats)
        rows.append((f"weight push{label}, {transport} ({mb:.1f} MB, {len(items)} tensors)",
                     f"{sec * 1e3:.1f} ms ({mb / 1024 / sec:.2f} GB/s)"))
    engine.weight_transport = "tensors"
    if checksums:
        sec = _timed(engine.checksums, 1)
        rows.append((f"checksums, readback of all weights ({mb:.1f} MB)", f"{sec * 1e3:.1f} ms"))
    return rows


def _generate(engine, prompts, warmup, sampling, per: str = "prompts"):
    """(groups, table value): response tokens/s and prompts/s of one `generate`, after a warm-up on
    other prompts (images are cached by vLLM under their hashes: a warm-up on the timed ones would
    skip their encoding)."""
    from dapo_megatron.rollout.types import Sampling
    engine.generate(warmup, Sampling(max_tokens=8))
    t0 = time.perf_counter()
    groups = engine.generate(prompts, sampling)
    dt = time.perf_counter() - t0
    tokens = sum(len(r) for grp in groups for r in grp.responses)
    return groups, f"{tokens / dt:,.0f} tok/s, {len(prompts) / dt:.2f} {per}/s ({tokens} tok, {dt:.2f} s)"


def _text_rows(args, tmp: str) -> list[tuple[str, str]]:
    """Start-up, generation and push rows of the `--kind` tiny model on random prompts."""
    import torch

    from dapo_megatron.assets.models import build_tiny_model
    from dapo_megatron.batch import Prompt
    from dapo_megatron.config.schema import RolloutConfig
    from dapo_megatron.rollout.engine import Engine
    from dapo_megatron.rollout.engine_spec import EngineSpec
    from dapo_megatron.rollout.types import Sampling
    path = build_tiny_model(args.kind, f"{tmp}/m", vocab_size=1024, seed=0)
    engine = Engine(EngineSpec.from_model(path, RolloutConfig(enforce_eager=True), dtype=args.dtype,
                    max_model_len=args.prompt_len + args.max_tokens + 8))
    rows = [("engine start-up (in-process)", f"{engine.startup_s:.1f} s")]
    g = torch.Generator().manual_seed(0)
    prompts = [Prompt(tuple(p)) for p in torch.randint(0, 1024, (args.prompts, args.prompt_len), generator=g).tolist()]
    sampling = Sampling(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)
    rows.append((f"generate {args.prompts} prompts x n={args.n} x {args.max_tokens} tok",
                 _generate(engine, prompts, prompts[:2], sampling)[1]))
    rows += _push_rows(engine, path, args.push_repeats)
    engine.shutdown()
    return rows


def _vl_rows(args, tmp: str) -> list[tuple[str, str]]:
    """The --vl rows: VL engine on figure prompts, then the text twin on text prompts as long."""
    import torch

    from dapo_megatron.assets.models import TINY_VL_MOE, build_tiny_model
    from dapo_megatron.assets.vl import build_vl_assets
    from dapo_megatron.batch import Prompt
    from dapo_megatron.config.schema import RolloutConfig
    from dapo_megatron.data import geo3k_synth
    from dapo_megatron.device.vision import load_processor
    from dapo_megatron.rollout.engine import Engine
    from dapo_megatron.rollout.engine_spec import EngineSpec
    from dapo_megatron.rollout.types import Sampling
    path = str(build_vl_assets(f"{tmp}/vl"))
    tokenizer = load_processor(path).tokenizer
    scenes = [geo3k_synth.make_scene(0, "train", i) for i in range(args.prompts + 2)]
    prompts = [Prompt(tuple(tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": s.question}]}],
        tokenize=True, add_generation_prompt=True, return_dict=False)), (geo3k_synth.render(s),)) for s in scenes]
    # ignore_eos: the bundle's tokenizer has an EOS the text twin never stops on; both run to max_tokens
    sampling = Sampling(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0, ignore_eos=True)
    rows = []
    engine = Engine(EngineSpec.from_model(path, RolloutConfig(enforce_eager=True), dtype=args.dtype, max_model_len=1024))
    rows.append(("engine start-up, VL", f"{engine.startup_s:.1f} s"))
    groups, vl_value = _generate(engine, prompts[:-2], prompts[-2:], sampling, per="images")
    lengths = [len(g.prompt) for g in groups]  # the prompts as vLLM expanded them
    label = f"generate {args.prompts} prompts x n={args.n} x {args.max_tokens} tok, {min(lengths)}-{max(lengths)} tok"
    vl_row = (f"{label}, VL (one {geo3k_synth.SIZE}x{geo3k_synth.SIZE} figure each)", vl_value)
    vl_push = _push_rows(engine, path, args.push_repeats, label=", VL (tower included)", checksums=False)
    engine.shutdown()

    text_cfg = {k: v for k, v in TINY_VL_MOE["text_config"].items()
                if k not in ("vocab_size", "rope_parameters", "tie_word_embeddings")}
    text_path = build_tiny_model("qwen3_moe", f"{tmp}/text", vocab_size=509, seed=0, **text_cfg)
    engine = Engine(EngineSpec.from_model(text_path, RolloutConfig(enforce_eager=True), dtype=args.dtype, max_model_len=1024))
    rows.append(("engine start-up, text", f"{engine.startup_s:.1f} s"))
    g = torch.Generator().manual_seed(0)
    text = [Prompt(tuple(torch.randint(0, 500, (n,), generator=g).tolist())) for n in lengths + lengths[:2]]
    rows += [(f"{label}, text (random ids)", _generate(engine, text[:-2], text[-2:], sampling)[1]), vl_row]
    rows += _push_rows(engine, text_path, args.push_repeats, label=", text", checksums=False) + vl_push
    engine.shutdown()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", default="qwen3_moe")
    p.add_argument("--vl", action="store_true", help="tiny VL bundle vs a text model of its text sizes")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--push-repeats", type=int, default=5)
    p.add_argument("--push-hidden", type=int, default=1024, help="hidden size of the wider push model; 0: skip")
    args = p.parse_args()

    import os

    from dapo_megatron.assets.models import build_tiny_model
    from dapo_megatron.config.schema import RolloutConfig
    from dapo_megatron.device import get_device
    os.environ.update(get_device("auto").vllm_env())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        import vllm.v1.engine.llm_engine  # noqa: F401  (timed apart from the engine start)
        from dapo_megatron.rollout.engine import Engine
        from dapo_megatron.rollout.engine_spec import EngineSpec
        rows.append(("import vllm + engine module", f"{time.perf_counter() - t0:.1f} s"))
        rows += _vl_rows(args, tmp) if args.vl else _text_rows(args, tmp)
        if args.push_hidden and not args.vl:  # a wider model, so that per-byte costs show
            kw = dict(hidden_size=args.push_hidden, moe_intermediate_size=args.push_hidden // 2,
                      intermediate_size=2 * args.push_hidden, num_experts=16)
            path = build_tiny_model(args.kind, f"{tmp}/wide", vocab_size=1024, seed=0, **kw)
            engine = Engine(EngineSpec.from_model(path, RolloutConfig(enforce_eager=True), dtype=args.dtype, max_model_len=64))
            rows += _push_rows(engine, path, max(1, args.push_repeats // 2))
            engine.shutdown()

    width = max(len(r[0]) for r in rows)
    kind = "qwen3_vl_moe vs qwen3_moe of its text sizes" if args.vl else args.kind
    print(f"\nrollout engine, {kind} tiny, {args.dtype}, device {get_device('auto').kind}")
    for name, value in rows:
        print(f"| {name:<{width}} | {value} |")
    write("rollout_throughput", title="Rollout engine throughput",
          measures="A tiny model in one in-process vLLM engine: its start-up, generation tokens/s and the time of a "
                   "weight push by transport.",
          tables=[Table("vl" if args.vl else "text", f"rollout engine, {kind} tiny, {args.dtype}, device "
                        f"{get_device('auto').kind}", ["measure", "result"], [list(r) for r in rows])])


if __name__ == "__main__":  # vLLM may spawn processes: the guard keeps them from re-running this
    main()
