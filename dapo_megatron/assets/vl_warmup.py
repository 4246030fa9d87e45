"""Supervised warm-up of the tiny Qwen3-VL-MoE on geo3k_synth rows, and its sampled accuracy.

As for the text models (assets/warmup.py): a random-init model never writes the geo3k format, so
every DAPO group would score the same and be dropped. A short warm-up on "<think>HINT</think>
\\boxed{ANSWER}<|im_end|>" teaches the format and the answers' ranges, and with luck some of the
counting; it stops at a modest sampled accuracy so RL has headroom.

Inputs are built the way the trainer sees them: the bundle's processor (device/vision.py's
load_processor, the engine's backend) renders the chat template, expands the one <|image_pad|> to
the image's grid tokens and gives pixel_values / image_grid_thw. Plain torch + HF transformers.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch
from PIL import Image

from dapo_megatron.assets.warmup import IGNORE_INDEX, train_steps
from dapo_megatron.data.images import load_images, split_image_placeholders
from dapo_megatron.reward.geo3k import format_ok
from dapo_megatron.reward.math_score import extract_boxed, math_verify_equal, prescreen

# A few words of "reasoning" per problem kind: the format needs <think>...</think>, and a response
# of ~10 tokens fits the quickstart's small max_response_length.
THINK = {"count": "count", "angle": "180 minus", "segments": "add"}


def response_text(kind: str, answer: str) -> str:
    return f"<think>{THINK[kind]}</think> \\boxed{{{answer}}}"


@dataclass(frozen=True)
class Example:
    prompt_ids: tuple[int, ...]  # chat-templated prompt, its <|image_pad|> expanded to the grid's tokens
    response_ids: tuple[int, ...]  # response_text + eos
    image: Image.Image
    answer: str
    kind: str


def make_examples(processor, rows: list[dict[str, Any]]) -> list[Example]:
    """geo3k rows (one image each) -> Examples, tokenized by the bundle's processor."""
    tokenizer, out = processor.tokenizer, []
    for row in rows:
        chat = split_image_placeholders(list(row["prompt"]), len(row["images"]))
        images = load_images(row["images"], base_dir=".")
        text = processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = processor(text=[text], images=list(images))["input_ids"][0]
        answer, kind = row["reward_model"]["ground_truth"], row["extra_info"]["kind"]
        response = tokenizer.encode(response_text(kind, answer), add_special_tokens=False) + [tokenizer.eos_token_id]
        out.append(Example(tuple(ids), tuple(response), images[0], answer, kind))
    return out


def _pad(rows: list[list[int]], value: int, *, left: bool) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([[value] * (width - len(r)) + r if left else r + [value] * (width - len(r)) for r in rows])


def model_inputs(processor, examples: list[Example], *, train: bool) -> dict[str, torch.Tensor]:
    """Batch inputs for Qwen3VLMoeForConditionalGeneration. train: prompt + response, right-padded,
    labels on the response only; else the prompts alone, left-padded for generate(). # [N, T]"""
    tokenizer = processor.tokenizer
    pad, image_id = tokenizer.pad_token_id, tokenizer.convert_tokens_to_ids(processor.image_token)
    rows = [list(e.prompt_ids) + (list(e.response_ids) if train else []) for e in examples]
    input_ids = _pad(rows, pad, left=not train)
    attention_mask = _pad([[1] * len(r) for r in rows], 0, left=not train)
    vision = processor.image_processor(images=[e.image for e in examples], return_tensors="pt")
    batch = {"input_ids": input_ids, "attention_mask": attention_mask,
             "mm_token_type_ids": (input_ids == image_id).long() * attention_mask,  # 1: image token
             "pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}
    if train:
        labels = _pad([[IGNORE_INDEX] * len(e.prompt_ids) + list(e.response_ids) for e in examples], IGNORE_INDEX,
                      left=False)
        batch["labels"] = labels
    return batch


def vl_warmup(model, processor, examples: list[Example], *, steps: int, batch_size: int, lr: float, seed: int,
              stop: Callable[[], bool] | None = None, check_every: int = 10) -> list[float]:
    """Up to `steps` AdamW steps on random batches of `examples`, asking `stop` every `check_every`
    steps; returns the loss of each step taken (the text warm-up's loop, `warmup.train_steps`)."""
    return train_steps(model, len(examples),
                       lambda idx: model_inputs(processor, [examples[i] for i in idx.tolist()], train=True),
                       steps=steps, batch_size=batch_size, lr=lr, seed=seed, stop=stop, check_every=check_every)


def is_correct(response: str, ground_truth: str) -> bool:
    """The geo3k reward's accuracy term: the last \\boxed{} against the ground truth (exact match,
    then math-verify; in-process, as the responses here are a few tokens)."""
    pred, result = prescreen(response, ground_truth, extract=extract_boxed)
    return result.acc if result is not None else math_verify_equal(pred, ground_truth)


@torch.no_grad()
def sampled_accuracy(model, processor, examples: list[Example], *, samples_per_prompt: int, temperature: float,
                     max_new_tokens: int, seed: int, batch_size: int = 16) -> dict[str, Any]:
    """Sample `samples_per_prompt` responses per example (HF generate, top-k/top-p off) and score
    them as the geo3k reward does: accuracy, format rate, and accuracy per problem kind."""
    model.eval()
    tokenizer = processor.tokenizer
    stop_ids = [tokenizer.eos_token_id, tokenizer.pad_token_id]  # generation_config's eos list
    correct, formatted, by_kind, seen = 0, 0, Counter(), Counter()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for start in range(0, len(examples), batch_size):
            chunk = examples[start:start + batch_size]
            inputs = model_inputs(processor, chunk, train=False)
            out = model.generate(**inputs, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, num_return_sequences=samples_per_prompt,
                                 eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            for i, text in enumerate(texts):
                example = chunk[i // samples_per_prompt]
                ok = is_correct(text, example.answer)
                correct += ok
                formatted += format_ok(text)
                by_kind[example.kind] += ok
                seen[example.kind] += 1
    total = sum(seen.values())
    return {"accuracy": round(correct / total, 4), "format": round(formatted / total, 4),
            "accuracy_by_kind": {k: round(by_kind[k] / seen[k], 4) for k in sorted(seen)}}
