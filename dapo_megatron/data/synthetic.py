"""The tiny task: single-digit addition ("3+4=" -> "\\boxed{7}"), as rows in the verl/DAPO schema.

A 1M-parameter model can learn it on CPU, and a supervised warm-up to ~30% sampled accuracy leaves
RL both signal and headroom (see assets/warmup.py). There are only 100 ordered pairs, so the
validation split is a held-out subset of them; see `split_pairs` for why that is still meaningful.
"""
from __future__ import annotations

import random
from typing import Any

DATA_SOURCE = "tiny_add"
SYSTEM_PROMPT = "Add the two numbers. Put the final answer in \\boxed{}."
NUM_VAL_PAIRS = 20

Pair = tuple[int, int]


def addition_pairs() -> list[Pair]:
    """All 100 ordered pairs (a, b) of single digits."""
    return [(a, b) for a in range(10) for b in range(10)]


def prompt_messages(a: int, b: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"{a}+{b}="}]


def response_text(a: int, b: int) -> str:
    """The reference completion, without the end-of-turn token (the chat template adds that)."""
    return f"\\boxed{{{a + b}}}"


def make_row(a: int, b: int, index: int, split: str) -> dict[str, Any]:
    """One row in the verl schema, the same one DAPO-Math-17k uses."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": prompt_messages(a, b),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"index": index, "split": split},
    }


def split_pairs(seed: int, num_val: int = NUM_VAL_PAIRS) -> tuple[list[Pair], list[Pair]]:
    """Shuffle the 100 pairs with `seed` and hold out `num_val` of them for validation.

    Held-out pairs are chosen so that the swapped pair (b, a) stays in training: the model has
    seen that sum, so validation asks it to generalize by commutativity, not to add digits it was
    never shown together. It does: after the warm-up, sampled accuracy on the held-out pairs was
    0.20-0.39 for 0.25-0.35 on the train pairs. Returns (train_pairs, val_pairs).
    """
    pairs = addition_pairs()
    random.Random(seed).shuffle(pairs)
    val: list[Pair] = []
    for a, b in pairs:
        if len(val) < num_val and a != b and (b, a) not in val:
            val.append((a, b))
    held = set(val)
    return [p for p in pairs if p not in held], val


def make_splits(seed: int, num_val: int = NUM_VAL_PAIRS) -> tuple[list[dict], list[dict]]:
    """(train_rows, val_rows): each pair once, in a seeded order, with no pair in both splits."""
    train_pairs, val_pairs = split_pairs(seed, num_val)
    train = [make_row(a, b, i, "train") for i, (a, b) in enumerate(train_pairs)]
    val = [make_row(a, b, i, "val") for i, (a, b) in enumerate(val_pairs)]
    return train, val
