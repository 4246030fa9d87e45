"""Tokens/s of one DAPO update: our Megatron actor vs HF transformers + torch AdamW, same model
and batch, one process, on the device `get_device("auto")` picks (CPU, or a lent GPU).

    python bench/actor_step.py [--samples 32] [--repeats 3]                      # CPU, tiny MoE
    python bench/actor_step.py --hidden 1024 --layers 8 --experts 16 --dtype bf16 \\
        --vocab 32000 --samples 256 --repeats 5                                  # GPU, adds MFU

Both sides run the same loss (algo.compute_policy_loss, token-mean, KL and entropy terms) on the
same random-init Qwen3-MoE (the defaults are assets.models' tiny one); the baseline runs the whole
batch as one right-padded forward. Tokens are real prompt + response tokens; the best of `repeats`
timed updates after one warm-up update, the device synchronized around each. With bf16, Megatron
keeps bf16 params and fp32 main params; the baseline is plain bf16 params + torch AdamW (no
master copy, so it does less work per step).

Model FLOPs (same count for both sides, padding not counted): 6 x active params x tokens, where
active = all params but the input embedding (a lookup) with expert weights scaled by top_k /
num_experts, plus attention 12 x layers x (heads x head_dim) x seq_len per token (PaLM's count,
no causal halving). MFU = achieved FLOP/s / peak (--peak-tflops; defaults are H100 SXM dense).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "distributed"))
import actor_jobs  # noqa: E402  (batch and config builders shared with the tests)

from dapo_megatron.device import get_device  # noqa: E402

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_PEAK_TFLOPS = {"bf16": 989.0, "fp32": 67.0}  # H100 SXM: dense bf16 tensor cores, fp32 non-tensor


def model_overrides(args) -> dict:
    """build_tiny_model overrides; hidden 128, 4 layers, 4 experts top-2 is the tiny model itself."""
    head_dim = min(128, args.hidden // 4)
    heads = args.hidden // head_dim
    return dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden, moe_intermediate_size=args.hidden,
                num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                head_dim=head_dim, num_experts=args.experts, num_experts_per_tok=args.topk)


def update_flops(hf_dir: str, seq_lens: list[int]) -> tuple[float, float]:
    """(model FLOPs of one update, active params per token); see the module docstring."""
    from transformers import AutoConfig, AutoModelForCausalLM
    hf = AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    share = hf.num_experts_per_tok / hf.num_experts
    active = sum(p.numel() * (share if ".experts." in name else 1.0)
                 for name, p in model.named_parameters() if "embed_tokens" not in name)
    attention = 12 * hf.num_hidden_layers * hf.num_attention_heads * hf.head_dim * sum(s * s for s in seq_lens)
    return 6 * active * sum(seq_lens) + attention, active


def best_tokens_per_s(step, tokens: int, repeats: int, dev) -> float:
    step()  # warm-up
    best = 0.0
    for _ in range(repeats):
        dev.synchronize()
        start = time.perf_counter()
        step()
        dev.synchronize()
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def megatron_tokens_per_s(hf_dir: str, batch, repeats: int, dtype: str, dev) -> float:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29561"))
    from dapo_megatron.config.schema import ParallelConfig
    from dapo_megatron.train.actor import Actor
    from dapo_megatron.train.parallel import init_parallel
    init_parallel(ParallelConfig(), dev)
    actor = Actor(actor_jobs.actor_config({}, ppo_mini_batch_size=len(batch), max_tokens_per_microbatch=16384),
                  hf_dir, n=1, total_steps=100, dtype=dtype)
    batch.old_logprobs = actor_jobs.perturbed_old(actor_jobs.everywhere(actor.compute_logprobs(batch))["logprobs"])
    batch.ref_logprobs = batch.old_logprobs - 0.05
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompts, batch.responses))
    return best_tokens_per_s(lambda: actor.update(batch), tokens, repeats, dev)


def hf_update(model, optimizer, batch, cfg, dev: torch.device) -> None:
    from dapo_megatron.algo import agg_loss, compute_policy_loss, entropy_from_logits, kl_penalty
    seqs = [torch.cat([p, r]) for p, r in zip(batch.prompts, batch.responses)]
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)  # [B, S]
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)], attn[i, : len(s)] = s, 1
    tokens, attn = tokens.to(dev), attn.to(dev)
    logits = model(input_ids=tokens, attention_mask=attn).logits  # [B, S, V]
    mask = batch.loss_mask.to(dev)  # [B, T]
    T = mask.shape[1]
    cols = torch.tensor([len(p) - 1 for p in batch.prompts])[:, None] + torch.arange(T)[None]  # [B, T]
    cols = cols.clamp(max=width - 1).to(dev)
    resp_logits = torch.gather(logits, 1, cols[..., None].expand(-1, -1, logits.shape[-1]))  # [B, T, V]
    targets = torch.gather(torch.roll(tokens, -1, 1), 1, cols)  # [B, T]
    logprobs = torch.log_softmax(resp_logits.float(), -1).gather(-1, targets[..., None])[..., 0] * mask
    entropy = entropy_from_logits(resp_logits.float())
    loss, _ = compute_policy_loss(batch.old_logprobs.to(dev), logprobs, batch.advantages.to(dev), mask,
                                  clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                                  clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode)
    loss = loss - cfg.entropy_coeff * agg_loss(entropy, mask, cfg.loss_agg_mode)
    loss = loss + cfg.kl_loss_coef * agg_loss(kl_penalty(logprobs, batch.ref_logprobs.to(dev), cfg.kl_loss_type),
                                              mask, cfg.loss_agg_mode)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
    optimizer.step()


def hf_tokens_per_s(hf_dir: str, batch, repeats: int, dtype: str, dev, impl: str) -> tuple[float, str]:
    """(tokens/s, "attention / experts implementation" that transformers picked)."""
    from transformers import AutoModelForCausalLM
    cfg = actor_jobs.actor_config({})
    kw = dict(attn_implementation="eager", experts_implementation="eager") if impl == "eager" else {}
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=_TORCH_DTYPES[dtype], **kw).to(dev.torch_device())
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                  betas=tuple(cfg.optim.betas))
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompts, batch.responses))
    c = model.config
    used = f"{c._attn_implementation} attention, {getattr(c, '_experts_implementation', '?')} experts"
    step = lambda: hf_update(model, optimizer, batch, cfg, dev.torch_device())  # noqa: E731
    return best_tokens_per_s(step, tokens, repeats, dev), used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=509)
    parser.add_argument("--dtype", choices=sorted(_TORCH_DTYPES), default="fp32")
    parser.add_argument("--hf-impl", choices=("default", "eager"), default="default",
                        help="HF attention / experts implementation: transformers' default or eager")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak of the device for --dtype (default: H100 SXM dense, bf16 989, fp32 67)")
    args = parser.parse_args()
    dev = get_device("auto")
    peak = (args.peak_tflops or _PEAK_TFLOPS[args.dtype]) * 1e12
    from dapo_megatron.assets.models import build_tiny_model
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = build_tiny_model("qwen3_moe", os.path.join(tmp, "moe"), vocab_size=args.vocab, **model_overrides(args))
        batch = actor_jobs.make_batch(n_samples=args.samples, vocab=args.vocab, max_prompt=64, max_response=128)
        seq_lens = [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)]
        flops, active = update_flops(hf_dir, seq_lens)
        ours = megatron_tokens_per_s(hf_dir, batch, args.repeats, args.dtype, dev)
        base, hf_impl = hf_tokens_per_s(hf_dir, batch, args.repeats, args.dtype, dev, args.hf_impl)
    tokens = sum(seq_lens)
    where = (f"{getattr(torch, dev.kind).get_device_name()}" if dev.is_accelerator
             else f"CPU, {torch.get_num_threads()} threads")
    print(f"one update, qwen3_moe hidden {args.hidden} x {args.layers} layers, {args.experts} experts top-{args.topk}, "
          f"vocab {args.vocab}, {args.dtype}, {args.samples} sequences, {tokens} tokens, {where}, 1 process")
    print(f"model FLOPs/update {flops / 1e12:.3f} T: 6 x {active / 1e6:.2f}M active params/token (input embedding "
          f"excluded) + attention 12 x layers x width x seq_len; HF: {hf_impl}")
    mfu = dev.is_accelerator
    print(f"{'implementation':<40}{'tokens/s':>12}{'TFLOP/s':>10}" + (f"{'MFU':>8}" if mfu else ""))
    for name, tps in (("megatron actor (ours)", ours), ("HF transformers + torch AdamW", base)):
        achieved = flops * tps / tokens
        print(f"{name:<40}{tps:>12.0f}{achieved / 1e12:>10.3f}" + (f"{achieved / peak:>8.1%}" if mfu else ""))
    print(f"{'ratio (goal >= 1.0)':<40}{ours / base:>12.2f}")
    if mfu:
        print(f"MFU vs peak {peak / 1e12:.0f} TFLOP/s ({args.dtype}; --peak-tflops to change)")


if __name__ == "__main__":
    main()
