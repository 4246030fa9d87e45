"""A crash and the restart a user makes, end to end: kill -9 of the driver in the middle of a step
(while the engines generate, then while the ranks update), the run resubmitted as multi-node
users run it (`ray start --head` on 127.0.0.1, `ray job submit -- python -m dapo_megatron.main`;
the driver finds the cluster through RAY_ADDRESS, which Ray sets for the job), and a damaged
checkpoint. The run resumes from the last checkpoint with no step lost or repeated and the prompt
stream exactly where the killed step had found it. The data plane needs nothing from the
checkpoint: the restarted run starts an empty one and regenerates the step."""
from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest
from test_driver import MAIN, _main, _overrides, _rows

from dapo_megatron.train.parallel import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def _job_submit(overrides, env) -> subprocess.CompletedProcess:
    """The run as a `ray job submit` to a head node of its own (stopped afterwards)."""
    gcs, dash, agent = free_port(), free_port(), free_port()
    # Ray 2.60 clusters require a token; give this test cluster its own, through the environment.
    env = {**env, "RAY_DISABLE_USAGE_STATS": "1", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    env.pop("RAY_ADDRESS", None)
    # 5 CPUs: the 2 ranks (sharing them with the engine) + the data plane's controller and units.
    # The job agent on a port of its own: a killed driver's local Ray leaves its agent on the
    # default one for a while, and jobs then fail with "No available agent to submit job".
    subprocess.run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=5",
                    "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                    f"--dashboard-agent-listen-port={agent}"],
                   check=True, env=env, capture_output=True, timeout=180)
    try:
        return subprocess.run([RAY, "job", "submit", f"--address=http://127.0.0.1:{dash}", "--", *MAIN, *overrides],
                              env=env, capture_output=True, text=True, timeout=600)
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_kill_9_mid_step_then_resume_loses_no_step_and_no_prompt(tiny_assets, tmp_path):
    """Early-stop collection (aborts push prompts back): killed while the engines generate step 2,
    resumed and killed while the ranks update step 3, resumed to the end through `ray job submit`;
    then one flipped bit in the newest checkpoint stops the next resume with one line naming it."""
    from dapo_megatron.driver.loop import KILL_AT
    out = tmp_path / "run"
    early_stop = {"algorithm.filter_groups.mode": "early_stop", "trainer.test_freq": 0}
    overrides = _overrides(tiny_assets, out, 3, **early_stop)
    env = {k: v for k, v in os.environ.items() if k != KILL_AT}
    env["RAY_ADDRESS"] = ""  # the killed runs start a local Ray of their own
    for kill, done in (("collect:2", [1]), ("update:3", [1, 2])):
        killed = _main(overrides, {**env, KILL_AT: kill})
        assert killed.returncode == -9, killed.stderr[-3000:]
        assert [r["step"] for r in _rows(out)] == done
    job = _job_submit(overrides, env)
    logs = job.stdout + job.stderr
    assert job.returncode == 0, logs[-3000:]
    assert "succeeded" in logs and "resumed from" in logs and "step_2" in logs and "step 3:" in logs, logs[-3000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Each step took exactly the prompts it scored from the stream (aborted ones went back), across
    # the kills too: nothing a killed attempt took was lost or served twice.
    for before, row in zip(rows, rows[1:]):
        assert row["data/prompts_consumed"] - before["data/prompts_consumed"] == row["sampling/generated_groups"]
    assert rows[0]["data/prompts_consumed"] == rows[0]["sampling/generated_groups"]
    assert all(r["data_plane/resident_mb"] == 0 for r in rows)
    assert "sampling/aborted_groups" in rows[2]
    assert sorted(os.listdir(out / "checkpoints"))[-1] == "step_3"

    damaged = sorted((out / "checkpoints" / "step_3").glob("*.distcp"))[0]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(bytes(data))
    resumed = _main(_overrides(tiny_assets, out, 4, **early_stop), env)
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    err = [line for line in resumed.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and f"{damaged} is damaged" in err[0] and "trainer.resume_mode" in err[0], err
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]  # nothing trained on the damaged weights
