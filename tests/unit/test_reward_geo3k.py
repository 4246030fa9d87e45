"""geo3k reward: verl's 0.9 x accuracy of the last \\boxed{} + 0.1 x format, chosen per row by
data_source, through a real RewardPool (its deadline included), the manager and the HTTP service."""
from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reward_http import serving

from dapo_megatron.config.schema import RewardConfig
from dapo_megatron.reward.client import RewardClient
from dapo_megatron.reward.geo3k import DATA_SOURCE as GEO
from dapo_megatron.reward.geo3k import format_ok
from dapo_megatron.reward.manager import RewardManager
from dapo_megatron.reward.math_score import NO_ANSWER, TIMEOUT
from dapo_megatron.reward.pool import RewardPool

TIMEOUT_S = 1.0
SLOW = "\\tan(\\tan(\\tan(\\tan(\\tan(1)))))"  # passes the caps; sympy needs ~18 s against "3"
VERL_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)  # verl's geo3k.format_reward


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=TIMEOUT_S) as p:
        yield p


@pytest.mark.parametrize("response,truth,expected,acc", [
    ("<think>The angles sum to 180.</think> So x = \\boxed{60}", "60", 1.0, True),
    ("<think>half of it</think>\nThe ratio is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0, True),  # math-verify
    ("x is \\boxed{60}", "60", 0.9, True),  # right, no think tags
    ("<think>60</think>\\boxed{60", "60", 0.0, False),  # box never closed: no answer, no format
    ("<think>hmm</think> \\boxed{61}", "60", 0.1, False),  # wrong, well formed
    ("<think>x is 60</think> so x is 60", "60", 0.0, False),  # no boxed answer
    ("<think>a</think> Answer: 60, or \\boxed{59}", "60", 0.1, False),  # the last box counts, not Answer:
    ("<think>\\boxed{60}</think> done", "60", 0.9, True),  # boxed inside the think block only
])
def test_scores_as_verl_does(pool, response, truth, expected, acc):
    (r,) = pool.score_batch([response], [truth], [GEO])
    assert (r.score, r.acc) == (pytest.approx(expected), acc)


PIECES = ["<think>", "</think>", "\\boxed{", "}", "{", "x", "\n", " <think>", "\\boxed"]


@pytest.mark.parametrize("response", [
    "<think></think>\\boxed{}", "<think>a</think>b\\boxed{c}d\n", "<think>\n</think>\n\\boxed{\n}\n",
    "<think><think></think></think>\\boxed{}", "<think>x</think>\\boxed{</think>}", " <think></think>\\boxed{1}",
    "<think>\\boxed{1}</think>", "<think></think>\\boxed{1", "<think>\\boxed{</think>}", "<think>x", "",
])
def test_format_matches_verls_regex(response):
    assert format_ok(response) == bool(VERL_FORMAT.fullmatch(response))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=10).map("".join))
def test_format_matches_verls_regex_on_generated_strings(response):
    assert format_ok(response) == bool(VERL_FORMAT.fullmatch(response))


def test_format_check_is_linear_on_adversarial_input():
    # The regex backtracks over every (</think>, \boxed{) pair here; the parent must not.
    response = "<think>" + "</think>\\boxed{" * 100_000  # 1.5 MB, no closing brace
    t0 = time.perf_counter()
    assert not format_ok(response) and format_ok(response + "}")
    assert time.perf_counter() - t0 < 0.5


R_THINK = "<think>2 + 1</think> \\boxed{3}"
R_ANSWER = "Answer: 5\nChecking again: \\boxed{3}"  # math reads "Answer:", geo3k the last box


def test_mixed_batch_is_scored_per_row(pool):
    rows = [  # (response, truth, data_source, score, pred)
        (R_THINK, "3", "math_dapo", 1.0, "3"),
        (R_THINK, "3", GEO, 1.0, "3"),
        (R_ANSWER, "3", "math_dapo", -1.0, "5"),
        (R_ANSWER, "3", GEO, 0.9, "3"),
        ("\\boxed{0.5}", "1/2", GEO, 0.9, "0.5"),
        ("<think></think>\\boxed{4}", "3", GEO, 0.1, "4"),
        ("<think></think>\\boxed{4}", "3", "tiny_add", -1.0, "4"),
        ("<think>no box</think>", "3", GEO, 0.0, ""),
    ]
    responses, truths, sources, scores, preds = map(list, zip(*rows))
    results = pool.score_batch(responses * 2, truths * 2, sources * 2)
    assert [r.score for r in results] == pytest.approx(scores * 2)
    assert [r.pred for r in results] == preds * 2
    assert [r.acc for r in results] == [s in (1.0, 0.9) for s in scores] * 2
    assert results[-1].reason == NO_ANSWER
    # Without data sources every row gets the math reward (the behaviour before the table).
    math_only = pool.score_batch(responses, truths)
    assert [r.score for r in math_only] == [1.0, 1.0, -1.0, -1.0, 1.0, -1.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="2 responses but 1 data_sources"):
        pool.score_batch(["a", "b"], ["1", "2"], [GEO])


def test_timeout_costs_only_that_row(pool):
    before = pool.stats()
    responses = [f"<think>t</think> \\boxed{{{SLOW}}}", R_THINK, "\\boxed{0.5}", R_ANSWER, R_THINK]
    t0 = time.monotonic()
    results = pool.score_batch(responses, ["3", "3", "1/2", "3", "3"], [GEO, GEO, GEO, GEO, "math"])
    assert time.monotonic() - t0 < TIMEOUT_S + 1.5  # margins for a loaded 2-core machine
    slow = results[0]
    assert (slow.reason, slow.acc, slow.score) == (TIMEOUT, False, pytest.approx(0.1))  # wrong, well formed
    assert [r.score for r in results[1:]] == pytest.approx([1.0, 0.9, 0.9, 1.0])
    assert [r.reason for r in results[1:]] == [""] * 4
    assert pool.stats()["timeouts"] - before["timeouts"] == 1


def test_manager_passes_data_sources_to_the_pool():
    with RewardManager(RewardConfig(num_workers=1, timeout_s=2.0), max_response_length=100) as manager:
        out = manager([R_ANSWER, R_ANSWER, "<think></think>\\boxed{2}"], ["3", "3", "3"], [5, 5, 5],
                      data_sources=["math", GEO, GEO])
    assert out.score.tolist() == pytest.approx([-1.0, 0.9, 0.1])
    assert out.acc.tolist() == [False, True, False] and out.pred == ["5", "3", "2"]
    assert out.metrics["reward/acc_mean"] == pytest.approx(1 / 3)


@pytest.fixture(scope="module")
def url(pool):
    with serving(pool) as address:
        yield address


def test_service_scores_each_row_by_its_source(url):
    # Longer than the tail the client sends for math rows: the <think> at the start must arrive.
    long_think = "<think>" + "angle " * 2000 + "</think> \\boxed{60}"
    client = RewardClient(url, request_timeout_s=30)
    results = client.score_batch([long_think, long_think, R_ANSWER], ["60", "60", "3"], [GEO, "math", GEO])
    assert [r.score for r in results] == pytest.approx([1.0, 1.0, 0.9])
    assert [r.score for r in client.score_batch([long_think, R_ANSWER], ["60", "3"])] == [1.0, -1.0]
    with RewardManager(RewardConfig(service_url=url), max_response_length=100) as manager:
        out = manager([long_think, "\\boxed{7}"], ["60", "60"], [10, 10], data_sources=[GEO, GEO])
    assert out.score.tolist() == pytest.approx([1.0, 0.0]) and out.acc.tolist() == [True, False]


def test_service_rejects_mismatched_data_sources(url):
    body = json.dumps({"responses": ["a"], "ground_truths": ["1"], "data_sources": [GEO, GEO]}).encode()
    req = urllib.request.Request(url + "/score", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and json.loads(e.value.read())["error"] == "1 responses but 2 data_sources"
