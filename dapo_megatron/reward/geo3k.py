"""geo3k reward (verl's preprocessed Geometry3k, data_source "hiyouga/geometry3k"), scored as verl
scores it: 0.9 x accuracy of the last \\boxed{} answer + 0.1 x format, where format means the
response is `<think>...</think>...\\boxed{...}...`. So 1.0, 0.9 (right, no think tags), 0.1 (wrong,
well formed) or 0.0; a timed-out or refused answer counts as wrong and keeps its format term.

Accuracy is the math reward's verdict (math_score: the same caps and exact-match fast path, then
math-verify in a `RewardPool` worker) on `math_score.extract_boxed`'s answer; this module only adds
the format term, which runs in the parent on the whole response, so it must stay linear-time.
"""
from __future__ import annotations

import dataclasses

from dapo_megatron.reward.math_score import RewardResult

DATA_SOURCE = "hiyouga/geometry3k"
FORMAT_WEIGHT = 0.1  # verl's geo3k `format_score`

_THINK_OPEN, _THINK_CLOSE, _BOXED_OPEN = "<think>", "</think>", "\\boxed{"


def format_ok(response: str) -> bool:
    """verl's `re.fullmatch(r"<think>.*</think>.*\\\\boxed\\{.*\\}.*", response, re.DOTALL)`, as
    three forward searches: taking the first match of each piece leaves the most room for the
    next, so the answer is the same, while the regex backtracks cubically on a response full of
    `</think>` and `\\boxed{` that never closes the brace."""
    if not response.startswith(_THINK_OPEN):
        return False
    close = response.find(_THINK_CLOSE, len(_THINK_OPEN))
    if close < 0:
        return False
    box = response.find(_BOXED_OPEN, close + len(_THINK_CLOSE))
    return box >= 0 and response.find("}", box + len(_BOXED_OPEN)) >= 0


def finish(result: RewardResult, response: str) -> RewardResult:
    """The math verdict on the boxed answer (acc) -> the geo3k score; reason and pred are kept."""
    score = (1.0 - FORMAT_WEIGHT) * result.acc + FORMAT_WEIGHT * format_ok(response)
    return dataclasses.replace(result, score=score)
