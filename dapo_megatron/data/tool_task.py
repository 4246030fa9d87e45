"""The tiny tool task: multiply two three-digit numbers, which the tiny model cannot do by hand
but can by calling the Python interpreter ("347*582=" -> a `python` tool call printing 347*582,
then "\\boxed{201954}" from the tool's answer). Rows in the verl/DAPO schema, like the addition task.

The warm-up (assets/tools.py) teaches the two turns on train pairs; validation pairs are unseen
pairs of numbers. Copying six digits into the call and six back out of the tool's message is
what the tiny model gets wrong sometimes, which leaves RL headroom.
"""
from __future__ import annotations

import json
import random
from typing import Any

DATA_SOURCE = "tiny_mul"
SYSTEM_PROMPT = "Multiply the two numbers with the python tool. Put the final answer in \\boxed{}."
NUM_TRAIN, NUM_VAL = 512, 64

Pair = tuple[int, int]


def pairs(seed: int, count: int) -> list[Pair]:
    """`count` distinct pairs of three-digit numbers whose product has six digits (a seeded draw)."""
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < count:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if a * b >= 100_000 and (a, b) not in seen:
            seen.add((a, b))
            out.append((a, b))
    return out


def prompt_messages(a: int, b: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"{a}*{b}="}]


def call_text(a: int, b: int) -> str:
    """The first assistant turn: one call of the built-in interpreter (Hermes / Qwen format)."""
    call = {"name": "python", "arguments": {"code": f"print({a}*{b})"}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def answer_text(a: int, b: int) -> str:
    return f"\\boxed{{{a * b}}}"


def make_row(a: int, b: int, index: int, split: str) -> dict[str, Any]:
    return {"data_source": DATA_SOURCE, "prompt": prompt_messages(a, b), "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"index": index, "split": split}}


def split_pairs(seed: int) -> tuple[list[Pair], list[Pair]]:
    drawn = pairs(seed, NUM_TRAIN + NUM_VAL)
    return drawn[:NUM_TRAIN], drawn[NUM_TRAIN:]


def make_splits(seed: int) -> tuple[list[dict], list[dict]]:
    train, val = split_pairs(seed)
    return ([make_row(a, b, i, "train") for i, (a, b) in enumerate(train)],
            [make_row(a, b, i, "val") for i, (a, b) in enumerate(val)])
