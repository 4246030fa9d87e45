"""Which reward scores a row: its data_source -> a `Scorer`. A source not in `SCORERS` gets the
math reward (DAPO's +1 / -1), so every dataset that predates this table scores as before.

Every scorer shares the math path: the parent extracts the answer and runs the linear-time
prescreen, a `RewardPool` worker runs math-verify under the deadline, and `finish` turns that
verdict into the source's score in the parent. A new source is a row here, not a new worker.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from dapo_megatron.reward import geo3k
from dapo_megatron.reward.math_score import RewardResult, extract_answer, extract_boxed


@dataclass(frozen=True)
class Scorer:
    name: str
    extract: Callable[[str], str | None]  # response -> its final answer (None: no answer)
    finish: Callable[[RewardResult, str], RewardResult]  # (math verdict, response) -> this source's score
    # False: the score reads only the response's last MAX_RESPONSE_CHARS, so the HTTP client may
    # send just those; geo3k's format term reads the start (`<think>`) too.
    whole_response: bool


def _math_finish(result: RewardResult, response: str) -> RewardResult:
    return result


MATH = Scorer("math", extract_answer, _math_finish, whole_response=False)
GEO3K = Scorer("geo3k", extract_boxed, geo3k.finish, whole_response=True)

SCORERS: dict[str, Scorer] = {
    geo3k.DATA_SOURCE: GEO3K,
}


def scorer_for(data_source: str | None) -> Scorer:
    return SCORERS.get(data_source, MATH)


def scorers_for(data_sources: Sequence[str] | None, batch: int) -> list[Scorer]:
    """One scorer per row; None (callers that predate data sources) means math for every row."""
    if data_sources is None:
        return [MATH] * batch
    if len(data_sources) != batch:
        raise ValueError(f"score_batch: {batch} responses but {len(data_sources)} data_sources")
    return [scorer_for(s) for s in data_sources]
