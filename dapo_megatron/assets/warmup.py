"""Supervised warm-up of a tiny model on the addition task, and its sampled accuracy.

A random-init model never writes "\\boxed{...}", so every DAPO group would score all-wrong and be
dropped by dynamic sampling: no signal. A short warm-up teaches the format and some sums; it is
kept short on purpose (sampled accuracy ~0.3 at temperature 1) so RL has headroom to show.
Plain torch + HF transformers; all prompts have the same length (digits are single tokens), so
batches need no padding on the prompt side.
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from dapo_megatron.data import synthetic
from dapo_megatron.data.synthetic import Pair

IGNORE_INDEX = -100  # HF causal-LM loss skips these label positions
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def prompt_ids(tokenizer, pairs: list[Pair]) -> torch.Tensor:
    """Chat-templated prompts with the generation header, # [N, P]."""
    rows = [tokenizer.encode(tokenizer.apply_chat_template(synthetic.prompt_messages(a, b), tokenize=False,
                                                           add_generation_prompt=True), add_special_tokens=False)
            for a, b in pairs]
    if len({len(r) for r in rows}) != 1:
        raise ValueError("task prompts must all have the same token length (is every digit one token?)")
    return torch.tensor(rows, dtype=torch.long)


def supervised_batch(tokenizer, pairs: list[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) for prompt + "\\boxed{a+b}<|im_end|>", loss on the response only. # [N, T]"""
    prompts = prompt_ids(tokenizer, pairs)  # [N, P]
    responses = [tokenizer.encode(synthetic.response_text(a, b), add_special_tokens=False) + [tokenizer.eos_token_id]
                 for a, b in pairs]
    width = prompts.shape[1] + max(len(r) for r in responses)
    input_ids = torch.full((len(pairs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    input_ids[:, :prompts.shape[1]] = prompts
    for i, response in enumerate(responses):
        end = prompts.shape[1] + len(response)
        input_ids[i, prompts.shape[1]:end] = torch.tensor(response)
        labels[i, prompts.shape[1]:end] = torch.tensor(response)
    return input_ids, labels


def supervised_warmup(model, tokenizer, pairs: list[Pair], *, steps: int, batch_size: int = 64, lr: float = 1e-3,
                      seed: int = 0, stop: Callable[[], bool] | None = None, check_every: int = 10,
                      batch: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[float]:
    """Up to `steps` AdamW steps on random batches of `pairs`; returns the loss of each step taken.
    batch: (input_ids, labels) of the pairs, when another task builds them (default: addition's).

    `stop` is asked every `check_every` steps and ends the warm-up when it returns True: how many
    steps reach a given accuracy varies a lot with the seed (the curve has a sharp knee).
    """
    input_ids, labels = batch if batch is not None else supervised_batch(tokenizer, pairs)
    return train_steps(model, len(pairs), lambda idx: dict(input_ids=input_ids[idx], labels=labels[idx]),
                       steps=steps, batch_size=batch_size, lr=lr, seed=seed, stop=stop, check_every=check_every)


def train_steps(model, n: int, inputs: Callable[[torch.Tensor], dict], *, steps: int, batch_size: int, lr: float,
                seed: int, stop: Callable[[], bool] | None = None, check_every: int = 10) -> list[float]:
    """The warm-ups' loop: up to `steps` AdamW steps, each on `inputs(idx)` (the HF model's kwargs,
    labels included) of `batch_size` random example indices out of `n`; `stop` asked every
    `check_every` steps. Returns the loss of each step taken."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(1, steps + 1):
        model.train()
        loss = model(**inputs(torch.randint(n, (batch_size,), generator=generator))).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if stop is not None and step % check_every == 0 and stop():
            break
    model.eval()
    return losses


@torch.no_grad()
def sample_responses(model, prompts: torch.Tensor, *, samples_per_prompt: int, eos_token_id: int, pad_token_id: int,
                     max_new_tokens: int, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """Ancestral sampling with a KV cache; tokens after eos are pad. # [N, P] -> [N*S, max_new_tokens]

    Each prompt is prefilled once and its cache repeated S times: the prefill is most of the cost.
    """
    out = model(input_ids=prompts, use_cache=True)
    out.past_key_values.batch_repeat_interleave(samples_per_prompt)
    logits = out.logits[:, -1].repeat_interleave(samples_per_prompt, dim=0)  # [N*S, V]
    done = torch.zeros(logits.shape[0], dtype=torch.bool)
    tokens = []
    for _ in range(max_new_tokens):
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # [N*S]
        nxt = torch.where(done, torch.full_like(nxt, pad_token_id), nxt)
        tokens.append(nxt)
        done |= nxt == eos_token_id
        if bool(done.all()):
            break
        out = model(input_ids=nxt[:, None], past_key_values=out.past_key_values, use_cache=True)
        logits = out.logits[:, -1]
    responses = torch.full((logits.shape[0], max_new_tokens), pad_token_id, dtype=torch.long)
    responses[:, :len(tokens)] = torch.stack(tokens, dim=1)
    return responses


def sampled_accuracy(model, tokenizer, pairs: list[Pair], *, samples_per_pair: int = 8, temperature: float = 1.0,
                     max_new_tokens: int = 16, seed: int = 0) -> float:
    """Fraction of sampled responses whose last \\boxed{...} equals the sum (the RL reward's rule)."""
    model.eval()
    responses = sample_responses(model, prompt_ids(tokenizer, pairs), samples_per_prompt=samples_per_pair,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                 max_new_tokens=max_new_tokens, temperature=temperature,
                                 generator=torch.Generator().manual_seed(seed))
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    correct = 0
    for i, text in enumerate(texts):
        a, b = pairs[i // samples_per_pair]
        found = BOXED.findall(text)
        correct += bool(found) and found[-1].strip() == str(a + b)
    return correct / len(texts)
