"""Reward service: HTTP round trip on 127.0.0.1 (ephemeral port), errors, the manager through it,
and the `python -m dapo_megatron.reward.serve` entry point."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
from reward_http import serving

from dapo_megatron.config.schema import RewardConfig
from dapo_megatron.reward.client import RewardClient
from dapo_megatron.reward.manager import RewardManager
from dapo_megatron.reward.pool import RewardPool

SLOW = "Answer: \\tan(\\tan(\\tan(\\tan(\\tan(1)))))"  # ~18 s in sympy: hits the 1 s deadline


@pytest.fixture(scope="module")
def url():
    with RewardPool(num_workers=1, timeout_s=1.0) as pool, serving(pool) as address:
        yield address


def test_round_trip_matches_local_scoring(url):
    client = RewardClient(url, request_timeout_s=30)
    results = client.score_batch(["Answer: 0.5", "\\boxed{2x+1}", "Answer: 5", "x" * 100_000, SLOW],
                                 ["1/2", "1+2x", "6", "1", "3"])
    assert [r.score for r in results] == [1.0, 1.0, -1.0, -1.0, -1.0]
    assert [r.pred for r in results[:3]] == ["0.5", "2x+1", "5"]
    assert [r.reason for r in results[3:]] == ["no_answer", "timeout"] and results[4].timed_out
    health = client.health()
    assert health["status"] == "ok" and health["num_workers"] == 1 and health["timeout_s"] == 1.0
    assert health["timeouts"] >= 1 and health["restarts"] >= 1


def test_bad_requests_get_json_errors(url):
    def post(path, body: bytes):
        req = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        return e.value.code, json.loads(e.value.read())["error"]

    assert post("/score", b"not json")[0] == 400
    assert post("/score", json.dumps({"responses": ["a"], "ground_truths": []}).encode()) == \
        (400, "1 responses but 0 ground_truths")
    assert post("/score", json.dumps({"responses": [1], "ground_truths": ["1"]}).encode()) == \
        (400, "'responses' must be a list of strings")
    assert post("/other", b"{}")[0] == 404
    with pytest.raises(RuntimeError, match=r"reward.service_url.*answered 404 on /nothing"):
        RewardClient(url)._request("/nothing", None)


def test_manager_scores_through_the_service(url):
    cfg = RewardConfig(service_url=url)
    with RewardManager(cfg, max_response_length=100) as manager:
        out = manager(["Answer: \\frac{\\sqrt2}{2}", "Answer: 1"], ["\\sqrt{2}/2", "2"], [10, 10])
    assert out.score.tolist() == [1.0, -1.0] and out.acc.tolist() == [True, False]
    assert "reward/worker_restarts_total" not in out.metrics  # the service owns its workers


def test_unreachable_service_names_the_key():
    with pytest.raises(RuntimeError, match=r"reward.service_url\) unreachable"):
        RewardClient("http://127.0.0.1:9", request_timeout_s=5).score_batch(["a"], ["1"])
    with pytest.raises(ValueError, match="reward.service_url must start with http"):
        RewardClient("127.0.0.1:8000")


def test_serve_entry_point_starts_answers_and_stops_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "dapo_megatron.reward.serve", "--port", "0",
                             "--workers", "1", "--timeout-s", "2"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        timer = threading.Timer(60, proc.kill)  # bounds the readline below if it never starts
        timer.start()
        line = proc.stderr.readline()
        timer.cancel()
        m = re.search(r"reward service on (http://127\.0\.0\.1:\d+) \(1 workers, 2\.0 s deadline\)", line)
        assert m, line
        results = RewardClient(m.group(1), request_timeout_s=30).score_batch(["Answer: 4"], ["4"])
        assert (results[0].score, results[0].acc) == (1.0, True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
