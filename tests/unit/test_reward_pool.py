"""RewardPool: worker processes, hard deadline with kill + restart, crash recovery, any thread."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from dapo_megatron.reward.math_score import TIMEOUT, TOO_DEEP, TOO_LONG, WORKER_DIED
from dapo_megatron.reward.pool import RewardPool

TIMEOUT_S = 1.0
# Passes every cap (depth 6, 31 characters) yet sympy takes ~18 s to compare it with 3: only the
# deadline stops it. Nested trig is the known residual of the caps.
SLOW = "Answer: \\tan(\\tan(\\tan(\\tan(\\tan(1)))))"
GOOD = ["Answer: 0.5", "\\boxed{\\frac{\\sqrt2}{2}}", "Answer: 1+2x", "Answer: 7"]
GOOD_TRUTHS = ["1/2", "\\sqrt{2}/2", "2x+1", "8"]


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=TIMEOUT_S) as p:
        yield p


def test_scores_in_input_order(pool):
    results = pool.score_batch(GOOD * 3, GOOD_TRUTHS * 3)
    assert [r.score for r in results] == [1.0, 1.0, 1.0, -1.0] * 3
    assert [r.pred for r in results[:4]] == ["0.5", "\\frac{\\sqrt2}{2}", "1+2x", "7"]
    assert all(0.0 <= r.elapsed_s < TIMEOUT_S for r in results)
    assert pool.score_batch([], []) == []


def test_slow_pair_is_killed_at_the_deadline_and_the_pool_keeps_scoring(pool):
    before = pool.stats()
    pids = set(pool.pids)
    t0 = time.monotonic()
    results = pool.score_batch([SLOW] + GOOD, ["3"] + GOOD_TRUTHS)
    elapsed = time.monotonic() - t0
    assert elapsed < TIMEOUT_S + 1.5  # margins for a loaded 2-core CI machine
    slow = results[0]
    assert (slow.score, slow.acc, slow.timed_out, slow.reason) == (-1.0, False, True, TIMEOUT)
    assert slow.pred.startswith("\\tan(") and TIMEOUT_S <= slow.elapsed_s < TIMEOUT_S + 1.0
    assert [r.score for r in results[1:]] == [1.0, 1.0, 1.0, -1.0]
    after = pool.stats()
    assert after["timeouts"] - before["timeouts"] == 1 and after["restarts"] - before["restarts"] == 1
    assert len(pids - set(pool.pids)) == 1  # exactly one worker was replaced
    again = pool.score_batch(GOOD, GOOD_TRUTHS)  # the replacement scores normally
    assert [r.score for r in again] == [1.0, 1.0, 1.0, -1.0]


def test_adversarial_batch_from_a_thread_returns_within_the_deadline(pool):
    responses = [SLOW, SLOW, "Answer: " + "{" * 40 + "1" + "}" * 40, "\\boxed{" + "9" * 1_000_000 + "}",
                 "x" * 1_000_000 + "\\boxed{10^{10^{10}}}", "Answer: 42"]
    out = {}

    def run():
        t0 = time.monotonic()
        out["results"] = pool.score_batch(responses, ["3", "3", "1", "9", "1", "42"])
        out["elapsed"] = time.monotonic() - t0

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    # Two slow pairs on two workers run side by side: one deadline, plus restarts and slack.
    assert out["elapsed"] < TIMEOUT_S + 1.5
    reasons = [r.reason for r in out["results"]]
    assert reasons[:2] == [TIMEOUT, TIMEOUT] and reasons[2] == TOO_DEEP
    assert reasons[3] == "no_answer"  # the box opens more than 4000 characters from the end
    assert reasons[4] == "huge_power" and reasons[5] == ""
    assert [r.score for r in out["results"]] == [-1.0] * 5 + [1.0]


def test_worker_killed_from_outside_is_replaced(pool):
    before = pool.stats()
    os.kill(pool.pids[0], signal.SIGKILL)  # idle worker: noticed when the next pair is sent
    time.sleep(0.1)
    results = pool.score_batch(GOOD, GOOD_TRUTHS)
    assert [r.score for r in results] == [1.0, 1.0, 1.0, -1.0]  # no pair lost: retried elsewhere
    assert pool.stats()["crashes"] - before["crashes"] == 1


def test_worker_killed_mid_pair_scores_that_pair_minus_one(pool):
    before = pool.stats()
    victim = threading.Timer(0.3, lambda: [os.kill(pid, signal.SIGKILL) for pid in pool.pids])
    victim.start()
    results = pool.score_batch([SLOW, SLOW], ["3", "3"])
    victim.join()
    assert [r.reason for r in results] == [WORKER_DIED, WORKER_DIED]
    assert pool.stats()["crashes"] - before["crashes"] == 2
    assert [r.score for r in pool.score_batch(GOOD, GOOD_TRUTHS)] == [1.0, 1.0, 1.0, -1.0]


def test_concurrent_batches_from_two_threads_get_their_own_results(pool):
    """The HTTP service calls score_batch from one thread per request: batches must not mix."""
    out = {}

    def run(name, responses, truths):
        out[name] = pool.score_batch(responses, truths)

    threads = [threading.Thread(target=run, args=("a", [f"Answer: {k}/4" for k in range(12)], ["0.5"] * 12)),
               threading.Thread(target=run, args=("b", [f"\\boxed{{{k}.0}}" for k in range(12)], ["3"] * 12))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert [r.pred for r in out["a"]] == [f"{k}/4" for k in range(12)]
    assert [r.acc for r in out["a"]] == [k == 2 for k in range(12)]
    assert [r.acc for r in out["b"]] == [k == 3 for k in range(12)]


def test_pool_created_and_closed_in_a_thread():
    out = {}

    def run():
        with RewardPool(num_workers=1, timeout_s=TIMEOUT_S) as p:
            out["results"] = p.score_batch(["Answer: 0.25", "\\boxed{" + "1+" * 200 + "1}"], ["1/4", "201"])
            out["pids"] = p.pids
        out["closed"] = p

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive()
    assert [(r.score, r.reason) for r in out["results"]] == [(1.0, ""), (-1.0, TOO_LONG)]
    with pytest.raises(RuntimeError, match="closed"):
        out["closed"].score_batch(["Answer: 1"], ["1"])
    time.sleep(0.2)
    for pid in out["pids"]:  # workers are gone (not even zombies: close() joined them)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_spawn_start_method_works_too():
    """Where forkserver is unavailable: fresh interpreters, slower (re)starts, same results."""
    with RewardPool(num_workers=1, timeout_s=TIMEOUT_S, start_method="spawn") as p:
        results = p.score_batch(GOOD, GOOD_TRUTHS)
    assert [r.score for r in results] == [1.0, 1.0, 1.0, -1.0]


def test_bad_arguments_name_the_config_key():
    with pytest.raises(ValueError, match="reward.timeout_s"):
        RewardPool(num_workers=1, timeout_s=0)
    with pytest.raises(ValueError, match="reward.num_workers"):
        RewardPool(num_workers=-1)
