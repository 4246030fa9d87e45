"""Check a converted model: Megatron logits (at any TP/PP/EP) vs HF transformers on a few prompts.

    python checkpoint_tools/verify.py --hf-dir HF [--ckpt MCORE_CKPT] --tp 2 --ep 2 [--tol 1e-4]

Builds the Megatron model at the requested layout, loads it from the HF dir (or from a Megatron
dist checkpoint with --ckpt), runs the prompts through Megatron's pipeline schedule, and compares
the logits with HF transformers in fp32. Prints the max |difference| per prompt; exits 1 above
--tol, 2 on bad input. A vision-language model (Qwen3-VL-MoE) takes the same text prompts, and
with --image TxHxW one random image of that patch grid before each prompt.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: the repo root replaces this folder on sys.path,
    # which would otherwise shadow the standard library's `inspect` with ours
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
from types import SimpleNamespace

import torch

from dapo_megatron.config.schema import ParallelConfig
from dapo_megatron.convert.run import checked_layout, world_for_layout
from dapo_megatron.models import ModelSpec, build_model
from dapo_megatron.parallel import coords
from dapo_megatron.train.integrity import check
from dapo_megatron.train.parallel import WorkerError, init_parallel, run_workers
from dapo_megatron.weights import CheckpointError, load_hf_checkpoint
from dapo_megatron.weights.load import unwrap

DEFAULT_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:",
                   "Solve for x: 3x + 5 = 20. First,"]


def megatron_logits(chunks, tokens: torch.Tensor, images: list | None = None) -> torch.Tensor | None:
    """Full-vocab logits [B, T, V_padded] through Megatron's schedule (any PP / VPP); the model's
    `Arch` row makes its inputs (positions [3, 1, T] for a vision-language model). `images`: per
    row, None or (pixel_values [N_patches, C*T*P*P], image_grid_thw [N_images, 3]).

    Returned on the last pipeline stage's TP rank 0; None elsewhere. T must divide by TP when
    sequence parallel is on.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    spec, c = unwrap(chunks[0]).spec, coords()
    b, t = tokens.shape
    images = images or [None] * b
    rows = [SimpleNamespace(tokens=row, **(dict(zip(("pixel_values", "image_grid_thw"), img)) if img else {}))
            for row, img in zip(tokens.split(1), images)]  # one micro-batch per row
    if len(chunks) > 1:  # the interleaved schedule wants at least PP micro-batches
        rows += [rows[0]] * max(0, c.pp - len(rows))
    captured = []

    def forward_step(data_iterator, model):
        inputs = spec.arch.inputs_fn(next(data_iterator), tokens.device, spec)
        out = spec.arch.forward_fn(model, inputs)  # last stage: [1, T, V/TP]; else hidden states

        def collect(output):
            captured.append(gather_from_tensor_model_parallel_region(output).detach())  # [1, T, V]
            return output.new_zeros(()), {}
        return out, collect

    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter(rows) for _ in chunks],
            model=chunks, num_microbatches=len(rows), seq_length=t, micro_batch_size=1, forward_only=True)
    if not (c.is_last_stage() and captured and c.tp_rank == 0):
        return None
    return torch.cat(captured[:b], dim=0)  # [B, T, V]


def _worker(hf_dir: str, ckpt: str | None, layout: dict, prompts: list, images: list) -> list:
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
    return [megatron_logits(chunks, p.unsqueeze(0), [img]) for p, img in zip(prompts, images)]


def _prompts(hf_dir: str, texts: list[str], lengths: list[int] | None = None) -> list[torch.Tensor]:
    """Token ids per prompt: random ids of `lengths` when given, or when there is no usable
    tokenizer."""
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
    return ids


def _with_images(spec, prompts: list, grid: tuple[int, int, int] | None) -> tuple[list, list]:
    """A vision-language model's prompts: no image token ids in the text (random ids may draw
    them); with `grid` ([t, h, w] patches), one random image before each prompt. Returns the
    prompts and per prompt None or (pixel_values, image_grid_thw [1, 3])."""
    if spec.vision_config is None:
        if grid:
            raise ValueError(f"--image: {spec.model_type} is not a vision-language model")
        return prompts, [None] * len(prompts)
    text = [p.masked_fill(p == spec.image_token_id, 0) for p in prompts]
    if not grid:
        return text, [None] * len(text)
    vc, hf = spec.vision_config, spec.hf
    hf = hf if isinstance(hf, dict) else hf.to_dict()
    merge = vc["spatial_merge_size"]
    t, h, w = grid
    if h % merge or w % merge:
        raise ValueError(f"--image {t}x{h}x{w}: h and w must divide by spatial_merge_size ({merge})")
    n_patches, patch_dim = t * h * w, vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2
    image = torch.tensor([hf["vision_start_token_id"]] + [spec.image_token_id] * (n_patches // merge ** 2)
                         + [hf["vision_end_token_id"]])
    g = torch.Generator().manual_seed(0)
    return ([torch.cat([image, p]) for p in text],
            [(torch.randn(n_patches, patch_dim, generator=g), torch.tensor([grid])) for _ in text])


def _hf_reference(hf_dir: str, spec):
    """HF transformers' model of `hf_dir` and a function (ids [1, n], image or None) -> logits."""
    if spec.vision_config is None:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        return lambda ids, image: model(ids).logits
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32)

    def run(ids, image):
        kw = dict(zip(("pixel_values", "image_grid_thw"), image)) if image else {}
        return model(input_ids=ids, mm_token_type_ids=(ids == spec.image_token_id).int(), **kw).logits
    return run


def verify(hf_dir: str, layout: dict, texts: list[str], ckpt: str | None = None,
           lengths: list[int] | None = None, image: tuple[int, int, int] | None = None) -> list[float]:
    """Max |Megatron - HF| logits per prompt (`texts`, or random ids of `lengths`; with `image`,
    a vision-language model's random image of that [t, h, w] patch grid before each)."""
    spec = ModelSpec.from_pretrained(hf_dir)
    layout = checked_layout(layout, spec)
    if ckpt:
        check(ckpt)  # a damaged file is named here, not found as a logits difference
    prompts, images = _with_images(spec, _prompts(hf_dir, texts, lengths), image)
    lengths = [len(p) for p in prompts]
    prompts = [torch.cat([p, p.new_zeros((-len(p)) % layout["tp"])]) for p in prompts]  # SP splits T
    per_rank = run_workers(_worker, world_for_layout(layout), hf_dir, ckpt, layout, prompts, images, timeout_s=1800)
    ours = next(r for r in per_rank if r[0] is not None)
    reference = _hf_reference(hf_dir, spec)
    diffs = []
    with torch.no_grad():
        for ids, n, img, logits in zip(prompts, lengths, images, ours):
            ref = reference(ids[:n].unsqueeze(0), img)  # [1, n, V]
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
    p.add_argument("--image", default=None, metavar="TxHxW",
                   help="vision-language model: a random image of this patch grid before each prompt (e.g. 1x8x12)")
    p.add_argument("--tol", type=float, default=1e-4)
    args = p.parse_args(argv)
    layout = dict(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    try:
        image = tuple(int(x) for x in args.image.split("x")) if args.image else None
        if image is not None and len(image) != 3:
            raise ValueError(f"--image {args.image}: want TxHxW, e.g. 1x8x12")
        diffs = verify(args.hf_dir, layout, args.prompt or DEFAULT_PROMPTS, args.ckpt, args.random_prompts, image)
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
