"""Tokens/s of one DAPO update: our Megatron actor vs HF transformers + torch AdamW, same model
and batch, one CPU process.

    python bench/actor_step.py [--samples 32] [--repeats 3]

Both sides run the same loss (algo.compute_policy_loss, token-mean, KL and entropy terms) on the
same tiny Qwen3-MoE; the baseline runs the whole batch as one right-padded forward. Tokens are
real prompt + response tokens; the best of `repeats` timed updates after one warm-up update.
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


def megatron_tokens_per_s(hf_dir: str, batch, repeats: int) -> float:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29561"))
    from dapo_megatron.config.schema import ParallelConfig
    from dapo_megatron.train.actor import Actor
    from dapo_megatron.train.parallel import init_parallel
    init_parallel(ParallelConfig())
    actor = Actor(actor_jobs.actor_config({}, ppo_mini_batch_size=len(batch), max_tokens_per_microbatch=16384),
                  hf_dir, n=1, total_steps=100)
    batch.old_logprobs = actor_jobs.perturbed_old(actor.compute_logprobs(batch, with_entropy=False)["logprobs"])
    batch.ref_logprobs = batch.old_logprobs - 0.05
    actor.update(batch)  # warm-up
    return max(actor.update(batch)["actor/tokens_per_s"] for _ in range(repeats))


def hf_update(model, optimizer, batch, cfg) -> None:
    from dapo_megatron.algo import agg_loss, compute_policy_loss, entropy_from_logits, kl_penalty
    seqs = [torch.cat([p, r]) for p, r in zip(batch.prompts, batch.responses)]
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)  # [B, S]
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)], attn[i, : len(s)] = s, 1
    logits = model(input_ids=tokens, attention_mask=attn).logits  # [B, S, V]
    mask = batch.loss_mask  # [B, T]
    T = mask.shape[1]
    cols = torch.tensor([len(p) - 1 for p in batch.prompts])[:, None] + torch.arange(T)[None]  # [B, T]
    cols = cols.clamp(max=width - 1)
    resp_logits = torch.gather(logits, 1, cols[..., None].expand(-1, -1, logits.shape[-1]))  # [B, T, V]
    targets = torch.gather(torch.roll(tokens, -1, 1), 1, cols)  # [B, T]
    logprobs = torch.log_softmax(resp_logits.float(), -1).gather(-1, targets[..., None])[..., 0] * mask
    entropy = entropy_from_logits(resp_logits.float())
    loss, _ = compute_policy_loss(batch.old_logprobs, logprobs, batch.advantages, mask,
                                  clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                                  clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode)
    loss = loss - cfg.entropy_coeff * agg_loss(entropy, mask, cfg.loss_agg_mode)
    loss = loss + cfg.kl_loss_coef * agg_loss(kl_penalty(logprobs, batch.ref_logprobs, cfg.kl_loss_type), mask,
                                              cfg.loss_agg_mode)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
    optimizer.step()


def hf_tokens_per_s(hf_dir: str, batch, repeats: int) -> float:
    from transformers import AutoModelForCausalLM
    cfg = actor_jobs.actor_config({})
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                  betas=tuple(cfg.optim.betas))
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompts, batch.responses))
    hf_update(model, optimizer, batch, cfg)  # warm-up
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        hf_update(model, optimizer, batch, cfg)
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from dapo_megatron.assets.models import build_tiny_model
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = build_tiny_model("qwen3_moe", os.path.join(tmp, "moe"), vocab_size=509)
        batch = actor_jobs.make_batch(n_samples=args.samples, max_prompt=64, max_response=128)
        ours = megatron_tokens_per_s(hf_dir, batch, args.repeats)
        base = hf_tokens_per_s(hf_dir, batch, args.repeats)
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompts, batch.responses))
    print(f"one update, tiny qwen3_moe, {args.samples} sequences, {tokens} tokens, CPU, 1 process, "
          f"{torch.get_num_threads()} threads")
    print(f"{'implementation':<40}{'tokens/s':>12}")
    print(f"{'megatron actor (ours)':<40}{ours:>12.0f}")
    print(f"{'HF transformers + torch AdamW':<40}{base:>12.0f}")
    print(f"{'ratio (goal >= 1.0)':<40}{ours / base:>12.2f}")


if __name__ == "__main__":
    main()
