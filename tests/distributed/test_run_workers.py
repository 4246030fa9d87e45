"""`run_workers` ranks are forks of a forkserver (train/forkserver.py); they still see the
caller's environment as of the call, and report their failures."""
import os

import pytest

from dapo_megatron.train.parallel import WorkerError, run_workers

import dist_jobs

pytestmark = pytest.mark.distributed


def test_ranks_see_the_callers_environment(monkeypatch):
    monkeypatch.setenv("DAPO_TEST_MARKER", "first")
    first = run_workers(dist_jobs.environment_probe, 2, timeout_s=120)
    # Set after the forkserver started: a fork of the server alone would not see it.
    monkeypatch.setenv("DAPO_TEST_MARKER", "second")
    monkeypatch.delenv("DAPO_TEST_MARKER_GONE", raising=False)
    second = run_workers(dist_jobs.environment_probe, 2, timeout_s=120)
    assert [r["marker"] for r in first] == ["first", "first"]
    assert [r["marker"] for r in second] == ["second", "second"]
    assert [r["rank"] for r in second] == ["0", "1"] and all(r["world"] == "2" for r in second)
    assert len({r["pid"] for r in first + second} | {os.getpid()}) == 5
    # forks of a server whose imports were frozen (dapo_megatron/heap.py): their collections skip them
    assert all(r["gc"][0] and r["gc"][1] > 100_000 for r in first + second), [r["gc"] for r in first]


def test_a_failing_rank_is_reported_by_rank():
    with pytest.raises(WorkerError, match="rank 1 says no"):
        run_workers(dist_jobs.fail_on_rank, 2, 1, timeout_s=120)

