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

    python bench/actor_step.py --vl [--samples 16] [--repeats 3]                 # VL vs text, same text sizes

--vl: the tiny Qwen3-VL-MoE (assets.models.TINY_VL_MOE; --hidden etc. do not apply) against a
Qwen3-MoE of the same text sizes, both sides (ours, HF), on the same token counts: each prompt is
one 224x224 image (a geo3k figure's size: grid 1x28x28, 784 patches, 196 image tokens, random
pixels) between ~60 text tokens; the text batch has the same ids with the image and vision tokens
replaced by text tokens, and no images. Tower share: the vision tower's inputs of the last timed
update are recorded (a forward hook), then the tower alone runs forward + backward on them (the
sum of its outputs as the loss; its gradient hooks, Megatron's grad buffers included, fire as in
the update), best of `repeats`, divided by the best update time. What it leaves out: writing the
image embeddings into the sequence and the deepstack additions (a masked scatter and adds).
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
from dapo_megatron.dtypes import DTYPES  # noqa: E402
from results import Table, write  # noqa: E402

MEASURES = ("One update (log-probs, loss, backward, optimizer) of our Megatron actor against HF transformers + torch "
            "AdamW on the same model and tokens, in one process: tokens/s, and with --vl the vision tower's share.")

_TORCH_DTYPES = {name: row.torch for name, row in DTYPES.items()}
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


def init_one_process(dev) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29561"))
    from dapo_megatron.config.schema import ParallelConfig
    from dapo_megatron.train.parallel import init_parallel
    init_parallel(ParallelConfig(), dev)


def megatron_step(hf_dir: str, batch, dtype: str):
    """(one update of `batch` by our actor, its vision tower or None); init_one_process first."""
    from dapo_megatron.train.actor import Actor
    actor = Actor(actor_jobs.actor_config({}, ppo_mini_batch_size=len(batch), max_tokens_per_microbatch=16384),
                  hf_dir, n=1, total_steps=100, dtype=dtype)
    batch.old_logprobs = actor_jobs.perturbed_old(actor_jobs.everywhere(actor.compute_logprobs(batch))["logprobs"])
    batch.ref_logprobs = batch.old_logprobs - 0.05
    return lambda: actor.update(batch), getattr(actor.chunks[0], "visual", None)


def hf_update(model, optimizer, batch, cfg, dev: torch.device) -> None:
    from dapo_megatron.algo import agg_loss, compute_policy_loss, entropy_from_logits, kl_penalty
    seqs = [torch.cat([p, r]) for p, r in zip(batch.prompts, batch.responses)]
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)  # [B, S]
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)], attn[i, : len(s)] = s, 1
    images = {}
    if batch.pixel_values is not None:  # the images of all rows, in row order, as HF takes them
        images = dict(pixel_values=torch.cat(batch.pixel_values).to(dev),
                      image_grid_thw=torch.cat(batch.image_grid_thw).to(dev),
                      mm_token_type_ids=(tokens == model.config.image_token_id).int().to(dev))
    tokens, attn = tokens.to(dev), attn.to(dev)
    logits = model(input_ids=tokens, attention_mask=attn, **images).logits  # [B, S, V]
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


def hf_step(hf_dir: str, batch, dtype: str, dev, impl: str):
    """(one update of `batch` by HF + AdamW, its vision tower or None, "attention / experts
    implementation" that transformers picked)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    cfg = actor_jobs.actor_config({})
    kw = dict(attn_implementation="eager", experts_implementation="eager") if impl == "eager" else {}
    vl = hasattr(AutoConfig.from_pretrained(hf_dir), "vision_config")
    auto = AutoModelForImageTextToText if vl else AutoModelForCausalLM
    model = auto.from_pretrained(hf_dir, dtype=_TORCH_DTYPES[dtype], **kw).to(dev.torch_device())
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                  betas=tuple(cfg.optim.betas))
    c = model.config
    used = f"{c._attn_implementation} attention, {getattr(c, '_experts_implementation', '?')} experts"
    step = lambda: hf_update(model, optimizer, batch, cfg, dev.torch_device())  # noqa: E731
    return step, (model.model.visual if vl else None), used


def timed(step, tower, tokens: int, repeats: int, dev) -> tuple[float, float]:
    """(best tokens/s of `step`, the tower's share of the best step time; 0 without a tower)."""
    if tower is None:
        return best_tokens_per_s(step, tokens, repeats, dev), 0.0
    calls = []
    hook = tower.register_forward_hook(lambda _m, args, kw, _out: calls.append((args, kw)), with_kwargs=True)
    tps = best_tokens_per_s(step, tokens, repeats, dev)
    hook.remove()
    last = calls[len(calls) - len(calls) // (repeats + 1):]  # the last update's calls

    def tower_step():
        for args, kw in last:
            out = tower(*args, **kw)
            (out.pooler_output.sum() + sum(f.sum() for f in out.deepstack_features)).backward()
    tower_s = 1 / best_tokens_per_s(tower_step, 1, repeats, dev)
    return tps, tower_s / (tokens / tps)


def vl_batches(n_samples: int, seed: int = 0):
    """(VL batch, text batch) of the same token ids but for the images: see the module docstring."""
    from dapo_megatron.assets.models import TINY_VL_MOE
    from dapo_megatron.batch import RolloutBatch
    vision = TINY_VL_MOE["vision_config"]
    image, start, end = (TINY_VL_MOE[k] for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id"))
    grid = torch.tensor([[1, 28, 28]])
    patch_dim = vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, image, (n,), generator=g).tolist()  # noqa: E731
    n_image = 2 + int(grid.prod()) // vision["spatial_merge_size"] ** 2  # with vision start / end
    vl, plain = [], []
    for i in range(n_samples):
        head, tail = text(int(torch.randint(20, 60, (1,), generator=g))), text(20)
        row = dict(responses=text(int(torch.randint(16, 128, (1,), generator=g))), group=i // 2, prompt_index=i // 2)
        vl.append(dict(row, prompts=head + [start] + [image] * (n_image - 2) + [end] + tail,
                       pixel_values=torch.randn(int(grid.prod()), patch_dim, generator=g), image_grid_thw=grid))
        plain.append(dict(row, prompts=head + text(n_image) + tail))
    advantages = torch.randn(n_samples, generator=g)
    batches = RolloutBatch.from_samples(vl), RolloutBatch.from_samples(plain)
    for b in batches:
        b.advantages = advantages.clone()
    return batches


def vl_main(args, dev) -> None:
    """The --vl table: ours and HF, text model vs VL model of the same text sizes, same tokens."""
    from dapo_megatron.assets.models import TINY_VL_MOE, build_tiny_model, build_tiny_vl_model
    text_cfg = {k: v for k, v in TINY_VL_MOE["text_config"].items()
                if k not in ("vocab_size", "rope_parameters", "tie_word_embeddings")}
    vl_batch, text_batch = vl_batches(args.samples)
    tokens = sum(vl_batch.sequence_lengths)
    init_one_process(dev)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = dict(text=build_tiny_model("qwen3_moe", f"{tmp}/text", vocab_size=509, **text_cfg),
                    VL=build_tiny_vl_model(f"{tmp}/vl"))
        for side in ("megatron actor (ours)", "HF transformers + torch AdamW"):
            for kind, batch in (("text", text_batch), ("VL", vl_batch)):
                if side.startswith("megatron"):
                    step, tower = megatron_step(dirs[kind], batch, args.dtype)
                else:
                    step, tower, _ = hf_step(dirs[kind], batch, args.dtype, dev, args.hf_impl)
                rows.append((side, kind, *timed(step, tower, tokens, args.repeats, dev)))
    t, v = TINY_VL_MOE["text_config"], TINY_VL_MOE["vision_config"]
    where = (f"{getattr(torch, dev.kind).get_device_name()}" if dev.is_accelerator
             else f"CPU, {torch.get_num_threads()} threads")
    print(f"one update, qwen3_vl_moe tiny (text hidden {t['hidden_size']} x {t['num_hidden_layers']} layers, "
          f"{t['num_experts']} experts top-{t['num_experts_per_tok']}, vocab {t['vocab_size']}; tower {v['depth']} "
          f"blocks, hidden {v['hidden_size']}) vs qwen3_moe of the same text sizes, {args.dtype}, {args.samples} "
          f"sequences, {tokens} tokens, {args.samples} images 224x224 (196 image tokens each), {where}, 1 process")
    print(f"{'implementation':<32}{'model':<7}{'tokens/s':>10}{'images/s':>10}{'tower share':>13}")
    for side, kind, tps, share in rows:
        images = f"{args.samples * tps / tokens:>10.2f}" if kind == "VL" else f"{'-':>10}"
        print(f"{side:<32}{kind:<7}{tps:>10.0f}{images}" + (f"{share:>13.1%}" if kind == "VL" else f"{'-':>13}"))
    for side, (_, _, text_tps, _), (_, _, vl_tps, _) in (("ours", rows[0], rows[1]), ("HF", rows[2], rows[3])):
        print(f"{'VL / text tokens/s, ' + side:<39}{vl_tps / text_tps:>10.2f}")
    print(f"{'ours / HF tokens/s, VL':<39}{rows[1][2] / rows[3][2]:>10.2f}")
    cells = lambda kind, tps, share: ([round(tps), "-", "-"] if kind == "text" else  # noqa: E731
                                      [round(tps), round(args.samples * tps / tokens, 1), f"{share:.0%}"])
    table = [[f"{'tiny Qwen3-VL-MoE' if kind == 'VL' else 'Qwen3-MoE of the VL model text sizes'} ({kind})",
              *cells(kind, ours[2], ours[3]), *cells(kind, hf[2], hf[3])] for kind, ours, hf in
             (("text", rows[0], rows[2]), ("VL", rows[1], rows[3]))]
    write("actor_step", title="One actor update: ours against HF transformers",
          measures=MEASURES, tables=[Table("vl", f"`--vl --samples {args.samples}`: {tokens} tokens, {args.samples} "
                                             f"images of 224x224, {args.dtype}, {where}",
                                             ["model", "ours tok/s", "ours images/s", "ours: tower's share", "HF tok/s",
                                              "HF images/s", "HF: tower's share"], table)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vl", action="store_true", help="tiny Qwen3-VL-MoE vs text model of its text sizes")
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
    if args.vl:
        return vl_main(args, dev)
    peak = (args.peak_tflops or _PEAK_TFLOPS[args.dtype]) * 1e12
    from dapo_megatron.assets.models import build_tiny_model
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = build_tiny_model("qwen3_moe", os.path.join(tmp, "moe"), vocab_size=args.vocab, **model_overrides(args))
        batch = actor_jobs.make_batch(n_samples=args.samples, vocab=args.vocab, max_prompt=64, max_response=128)
        seq_lens = [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)]
        flops, active = update_flops(hf_dir, seq_lens)
        tokens = sum(seq_lens)
        init_one_process(dev)
        ours = best_tokens_per_s(megatron_step(hf_dir, batch, args.dtype)[0], tokens, args.repeats, dev)
        step, _, hf_impl = hf_step(hf_dir, batch, args.dtype, dev, args.hf_impl)
        base = best_tokens_per_s(step, tokens, args.repeats, dev)
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
    share = lambda tps: flops * tps / tokens / peak  # noqa: E731
    write("actor_step", title="One actor update: ours against HF transformers", measures=MEASURES,
          tables=[Table("text", f"qwen3_moe hidden {args.hidden} x {args.layers} layers, {args.experts} experts "
                        f"top-{args.topk}, {args.samples} sequences, {tokens} tokens; HF: {hf_impl}",
                        ["device", "ours tok/s", "HF + torch AdamW tok/s", "ours / HF", "MFU ours / HF"],
                        [[f"{where}, {args.dtype}", round(ours), round(base), f"{ours / base:.2f}x",
                          f"{share(ours):.1%} / {share(base):.1%}" if mfu else "-"]])])


if __name__ == "__main__":
    main()
