"""Check a converted model: Megatron logits (at any TP/PP/EP) vs HF transformers on a few prompts.

    python checkpoint_tools/verify.py --hf-dir HF [--ckpt MCORE_CKPT] --tp 2 --ep 2 [--tol 1e-4]

Builds the Megatron model at the requested layout, loads it from the HF dir (or from a Megatron
dist checkpoint with --ckpt), runs the prompts through Megatron's pipeline schedule, and compares
the logits with HF transformers in fp32. Prints the max |difference| per prompt; exits 1 above
--tol, 2 on bad input.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: the repo root replaces this folder on sys.path,
    # which would otherwise shadow the standard library's `inspect` with ours
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse


import torch

DEFAULT_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:",
                   "Solve for x: 3x + 5 = 20. First,"]


def megatron_logits(chunks, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab logits [B, T, V_padded] through Megatron's schedule (any PP / VPP).

    Returned on the last pipeline stage's TP rank 0; None elsewhere. T must divide by TP when
    sequence parallel is on.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    b, t = tokens.shape
    rows = list(tokens.split(1))  # one micro-batch per row
    if len(chunks) > 1:  # the interleaved schedule wants at least PP micro-batches
        rows += [rows[0]] * max(0, mpu.get_pipeline_model_parallel_world_size() - len(rows))
    pos = torch.arange(t, device=tokens.device).unsqueeze(0)  # [1, T]
    captured = []

    def forward_step(data_iterator, model):
        out = model(next(data_iterator), pos, None)  # last stage: [1, T, V/TP]; else hidden states

        def collect(output):
            captured.append(gather_from_tensor_model_parallel_region(output).detach())  # [1, T, V]
            return output.new_zeros(()), {}
        return out, collect

    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter(rows) for _ in chunks],
            model=chunks, num_microbatches=len(rows), seq_length=t, micro_batch_size=1, forward_only=True)
    last = mpu.is_pipeline_last_stage(ignore_virtual=True)
    if not (last and captured and mpu.get_tensor_model_parallel_rank() == 0):
        return None
    return torch.cat(captured[:b], dim=0)  # [B, T, V]


def _worker(hf_dir: str, ckpt: str | None, layout: dict, prompts: list) -> list:
    from dapo_megatron.config.schema import ParallelConfig
    from dapo_megatron.models import ModelSpec, build_model
    from dapo_megatron.train.parallel import init_parallel
    from dapo_megatron.weights import load_hf_checkpoint
    init_parallel(ParallelConfig(**layout))
    chunks = build_model(ModelSpec.from_pretrained(hf_dir), dtype="fp32", perform_initialization=False)
    if ckpt:
        from megatron.core import dist_checkpointing
        state = dist_checkpointing.load({"model": chunks[0].sharded_state_dict()}, ckpt)
        chunks[0].load_state_dict(state["model"], strict=True)
    else:
        load_hf_checkpoint(chunks, hf_dir)
    for c in chunks:
        c.eval()
    return [megatron_logits(chunks, p.unsqueeze(0)) for p in prompts]


def _prompts(hf_dir: str, texts: list[str], tp: int, lengths: list[int] | None = None):
    """Token ids per prompt, right-padded to a multiple of TP (sequence parallel splits T), and
    their lengths. Random ids of `lengths` when given, or when there is no usable tokenizer."""
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(hf_dir).get_text_config().vocab_size
    ids = []
    if lengths is None and os.path.exists(os.path.join(hf_dir, "tokenizer.json")):
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(hf_dir)
        ids = [torch.tensor(tok(t)["input_ids"], dtype=torch.long) for t in texts]
    if not ids or any(len(i) == 0 or int(i.max()) >= vocab for i in ids):
        g = torch.Generator().manual_seed(0)  # fixed random ids stand in for text
        ids = [torch.randint(0, vocab, (n,), generator=g) for n in lengths or [8 + 3 * i for i in range(len(texts))]]
    lengths = [len(i) for i in ids]
    padded = [torch.cat([i, i.new_zeros((-len(i)) % tp)]) for i in ids]
    return padded, lengths


def verify(hf_dir: str, layout: dict, texts: list[str], ckpt: str | None = None,
           lengths: list[int] | None = None) -> list[float]:
    """Max |Megatron - HF| logits per prompt (`texts`, or random ids of `lengths`)."""
    from transformers import AutoModelForCausalLM

    from dapo_megatron.convert import checked_layout, world_for_layout
    from dapo_megatron.models import ModelSpec
    from dapo_megatron.train.integrity import check
    from dapo_megatron.train.parallel import run_workers
    layout = checked_layout(layout, ModelSpec.from_pretrained(hf_dir))
    if ckpt:
        check(ckpt)  # a damaged file is named here, not found as a logits difference
    prompts, lengths = _prompts(hf_dir, texts, layout["tp"], lengths)
    per_rank = run_workers(_worker, world_for_layout(layout), hf_dir, ckpt, layout, prompts, timeout_s=1800)
    ours = next(r for r in per_rank if r[0] is not None)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    diffs = []
    with torch.no_grad():
        for ids, n, logits in zip(prompts, lengths, ours):
            ref = model(ids[:n].unsqueeze(0)).logits  # [1, n, V]
            diffs.append((logits[:, :n, :ref.shape[-1]] - ref).abs().max().item())
    return diffs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="HF checkpoint (the reference, and config/tokenizer)")
    p.add_argument("--ckpt", default=None, help="Megatron dist checkpoint to load instead of --hf-dir")
    for name in ("tp", "pp", "ep", "etp"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.add_argument("--prompt", action="append", default=None, help="repeatable; default: 3 built-in prompts")
    p.add_argument("--random-prompts", type=int, nargs="+", default=None, metavar="LEN",
                   help="random token ids of these lengths instead of text (no tokenizer needed)")
    p.add_argument("--tol", type=float, default=1e-4)
    args = p.parse_args(argv)
    from dapo_megatron.train.parallel import WorkerError
    from dapo_megatron.weights import CheckpointError
    layout = dict(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    try:
        diffs = verify(args.hf_dir, layout, args.prompt or DEFAULT_PROMPTS, args.ckpt, args.random_prompts)
    except (WorkerError, CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, d in enumerate(diffs):
        print(f"prompt {i}: max |logits diff| = {d:.3e}")
    worst = max(diffs)
    print(f"{'OK' if worst <= args.tol else 'FAIL'}: max |logits diff| {worst:.3e} (tol {args.tol:g}) "
          f"at tp={args.tp} pp={args.pp} ep={args.ep} etp={args.etp}")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
