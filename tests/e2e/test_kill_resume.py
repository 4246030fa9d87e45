"""kill -9 of the driver in the middle of a step (while the engines generate, while the ranks
update), then a restart: the run resumes from the last checkpoint with no step lost or repeated
and the prompt stream exactly where the killed step had found it. The data plane needs nothing
from the checkpoint: the restarted run starts an empty one and regenerates the step."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_driver import _cfg, _overrides, _rows

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _main(overrides, env, timeout=600):
    return subprocess.run([sys.executable, "-m", "dapo_megatron.main", "--config-name", "quickstart", *overrides],
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_kill_9_mid_step_then_resume_loses_no_step_and_no_prompt(tiny_assets, tmp_path):
    """Early-stop collection (aborts push prompts back): killed while the engines generate step 2,
    resumed and killed while the ranks update step 3, resumed to the end."""
    from dapo_megatron.driver.loop import KILL_AT
    out = tmp_path / "run"
    overrides = _overrides(tiny_assets, out, 3, **{"algorithm.filter_groups.mode": "early_stop",
                                                    "trainer.test_freq": 0})
    env = {k: v for k, v in os.environ.items() if k != KILL_AT}
    for kill, done in (("collect:2", [1]), ("update:3", [1, 2])):
        killed = _main(overrides, {**env, KILL_AT: kill})
        assert killed.returncode == -9, killed.stderr[-3000:]
        assert [r["step"] for r in _rows(out)] == done
    resumed = _main(overrides, env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step_2" in resumed.stdout
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Each step took exactly the prompts it scored from the stream (aborted ones went back), across
    # the kills too: nothing a killed attempt took was lost or served twice.
    for before, row in zip(rows, rows[1:]):
        assert row["data/prompts_consumed"] - before["data/prompts_consumed"] == row["sampling/generated_groups"]
    assert rows[0]["data/prompts_consumed"] == rows[0]["sampling/generated_groups"]
    assert all(r["data_plane/resident_mb"] == 0 for r in rows)


def test_ranks_read_their_share_at_dp2_and_the_same_rows_at_tp2(tiny_assets, tmp_path):
    """Quickstart layout (2 ranks, DP2 with EP2): each rank reads about half of what a rank reads
    at TP2 (DP1: both TP peers read every row), and the two DP ranks read within 1.1x of each other."""
    import ray

    from dapo_megatron.driver.loop import run
    reads = {}
    for name, layout in {"dp2": {}, "tp2": {"actor.parallel.tp": 2, "actor.parallel.ep": 1,
                                             "actor.parallel.etp": 2}}.items():
        out = tmp_path / name
        try:
            assert run(_cfg(tiny_assets, out, 1, **layout, **{"algorithm.filter_groups.enable": "false",
                                                               "trainer.test_freq": 0})) == 0
        finally:
            ray.shutdown()
        reads[name] = [(r["data_plane/bytes_get"], r["data_plane/bytes_get_max"]) for r in _rows(out)]
    for mean, largest in reads["tp2"]:
        assert largest == mean  # TP peers read the same rows
    for (mean, largest), (tp_mean, _) in zip(reads["dp2"], reads["tp2"]):
        assert largest <= 1.1 * mean and largest <= 0.6 * tp_mean, (reads)
