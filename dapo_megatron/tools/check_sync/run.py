"""The check of `python -m dapo_megatron.tools.check_sync` (see its __init__.py), and the pieces
tests and bench/weight_sync.py reuse: `start` / `release` the driver's training ranks and engine
around a config (`sync_config`), HF transformers' log-probs of the engine's responses
(`hf_logprobs`, `max_logprob_diff`).
"""
from __future__ import annotations

import tempfile
import time
from typing import Optional

import numpy as np
import ray
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from dapo_megatron.batch import Prompt, RolloutBatch
from dapo_megatron.config import check_model, load_config
from dapo_megatron.convert.run import copy_aux, world_for_layout
from dapo_megatron.driver.placement import init_ray, place
from dapo_megatron.driver.weight_sync import sync_weights
from dapo_megatron.models import ModelSpec
from dapo_megatron.rollout.types import Sampling
from dapo_megatron.weights import HFCheckpoint
from dapo_megatron.weights.hf_io import finalize_shards

RESPONSE_TOKENS = 16


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
    ray.get([e.shutdown.remote() for e in placement.engines])
    placement.release()


def check_sync(hf_dir: str, args) -> dict:
    """Run the check once; returns {"max_abs_logprob_diff", "weight_change", "checksums",
    "image_prompts", timings} (and "vision_weight_change" for a VL model)."""
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
            copy_aux(hf_dir, tmp, args.dtype)
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
    auto = AutoModelForCausalLM if spec.image_token_id is None else AutoModelForImageTextToText
    return auto.from_pretrained(path, dtype=torch.float32).eval()
