"""In-process math reward: extraction, equivalences via math-verify, safety caps before parsing."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_megatron.reward.math_score import (HUGE_POWER, MAX_ANSWER_CHARS, NO_ANSWER, TOO_DEEP, TOO_LONG,
                                             extract_answer, has_huge_power, last_boxed, nesting_depth,
                                             normalize, score)

EQUIVALENT = [
    ("Answer: 0.5", "1/2"),
    ("Answer: 1/2", "0.5"),
    ("The result is $\\boxed{\\frac{1}{2}}$.", "0.5"),
    ("Answer: \\frac12", "\\frac{1}{2}"),
    ("Answer: $\\sqrt{2}/2$", "\\frac{\\sqrt2}{2}"),
    ("Answer: 1+2x", "2x+1"),
    ("Let me compute.\n6 * 7 = 42\nAnswer: 42", "42"),
    ("**Answer:** $\\dfrac{3}{4}$", "0.75"),
    ("so we get \\fbox{12}", "12"),
    ("thus \\boxed 7 is it", "7"),
    ("Answer: \\boxed{2^{10}}", "1024"),
    ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}"),
]


@pytest.mark.parametrize("response,truth", EQUIVALENT)
def test_equivalent_notations_score_plus_one(response, truth):
    r = score(response, truth)
    assert (r.score, r.acc, r.reason) == (1.0, True, "")


def test_last_answer_line_wins_over_earlier_lines_and_boxes():
    response = "First try. Answer: 41\nHmm, \\boxed{40}\nNo wait.\nAnswer: 42"
    r = score(response, "42")
    assert (r.score, r.acc, r.pred) == (1.0, True, "42")
    r = score("Answer: 42\nActually I was wrong.\nAnswer: 41", "42")
    assert (r.score, r.acc, r.pred) == (-1.0, False, "41")


@pytest.mark.parametrize("response,truth", [("Answer: 43", "42"), ("\\boxed{0.51}", "1/2"),
                                            ("Answer: 2x-1", "2x+1"), ("Answer: \\sqrt{3}/2", "\\frac{\\sqrt2}{2}")])
def test_wrong_answers_score_minus_one(response, truth):
    r = score(response, truth)
    assert (r.score, r.acc, r.reason) == (-1.0, False, "")
    assert r.pred == extract_answer(response)


@pytest.mark.parametrize("response", ["I think it is 42", "", "Answer:", "\\boxed{42", "Answer:   \n"])
def test_no_answer_scores_minus_one(response):
    r = score(response, "42")
    assert (r.score, r.acc, r.pred, r.reason) == (-1.0, False, "", NO_ANSWER)


def test_extraction_details():
    assert extract_answer("Answer: \\(\\frac{1}{3}\\).") == "\\frac{1}{3}"
    assert extract_answer("answer : $5$") == "5"
    assert extract_answer("Answer:\n$$12$$") == "12"
    assert extract_answer("\\boxed{a} then \\boxed{\\frac{b}{c}}") == "\\frac{b}{c}"
    assert last_boxed("\\boxed{x^{2}+\\{1\\}}") == "x^{2}+\\{1\\}"
    assert last_boxed("no box") is None
    assert normalize(" $2x + 1$. ") == "2x+1" and normalize("\\left(1,2\\right)") == "(1,2)"
    assert normalize("1\\,000") == "1000" and normalize("\\leftarrow") != normalize("\\rightarrow")


def test_integer_ground_truth_from_a_parquet_column_is_accepted():
    assert score("Answer: 42", 42).acc is True


def test_caps_refuse_before_parsing():
    assert nesting_depth("\\left(\\frac{\\sqrt{3}}{2}, 1\\right)") == 3
    assert has_huge_power("10^{10^{10}}") and has_huge_power("2^{99999}") and has_huge_power("9^9^9")
    assert has_huge_power("2**3**4") and has_huge_power("12345!")
    assert not has_huge_power("x^2+y^{10}") and not has_huge_power("2^{2024}") and not has_huge_power("5!")
    assert not has_huge_power("e^{x^2}") and not has_huge_power("e^{\\pi^{2}}") and not has_huge_power("x^y^z")
    assert has_huge_power("2^{\\frac{10^{10}}{2}}") and has_huge_power("2^{10!}")
    assert score("Answer: " + "{" * 20 + "1" + "}" * 20, "1").reason == TOO_DEEP
    assert score("\\boxed{10^{10^{10}}}", "1").reason == HUGE_POWER
    long = score("\\boxed{" + "1+" * 150 + "1}", "151")
    assert long.reason == TOO_LONG and long.score == -1.0 and len(long.pred) == MAX_ANSWER_CHARS


ADVERSARIAL = {
    "deep_nesting": ("Answer: " + "{" * 30 + "1" + "}" * 30, TOO_DEEP),
    "megabyte_string": ("9" * 1_000_000 + " Answer: " + "(" * 2_000, TOO_LONG),
    "megabyte_no_answer": ("x" * 1_000_000, NO_ANSWER),
    "huge_exponent": ("so \\boxed{10^{10^{10}}}", HUGE_POWER),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_inputs_return_fast_in_process(name):
    response, reason = ADVERSARIAL[name]
    t0 = time.perf_counter()
    r = score(response, "1")
    assert time.perf_counter() - t0 < 0.5
    assert (r.score, r.acc, r.reason) == (-1.0, False, reason)


def test_score_works_off_the_main_thread():
    """math-verify's own alarm-based timeouts raise off the main thread; ours are disabled."""
    out = {}

    def run():
        t0 = time.perf_counter()
        out["good"] = score("Answer: \\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2")
        out["bad"] = [score(resp, "1") for resp, _ in ADVERSARIAL.values()]
        out["elapsed"] = time.perf_counter() - t0

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    assert out["good"].score == 1.0
    assert [r.score for r in out["bad"]] == [-1.0] * len(ADVERSARIAL)
    assert out["elapsed"] < 5.0


def test_scoring_in_a_fresh_process_prints_no_timeout_warning():
    """Scoring in-process (the VL bundle's warm-up, on the console of a demo's first use) prints
    nothing: math-verify's "Timeout is disabled" warning is for a choice this module made."""
    code = ("from dapo_megatron.reward.math_score import score; "
            "assert score('Answer: \\\\frac12', '0.5').score == 1.0")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Timeout is disabled" not in run.stderr + run.stdout


@settings(max_examples=60, deadline=None)
@given(prefix=st.text(max_size=300),
       answer=st.from_regex(r"[0-9a-z]([0-9a-z+\-*/.=]{0,28}[0-9a-z])?", fullmatch=True))
def test_extraction_finds_the_final_answer_line(prefix, answer):
    """Whatever comes before, a final "Answer: x" line is what gets extracted."""
    assert extract_answer(prefix + "\nAnswer: " + answer) == answer
    assert extract_answer(prefix + "\nAnswer: $" + answer + "$.") == answer
