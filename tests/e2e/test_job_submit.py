"""Multi-node entry as users run it: `ray start --head` on 127.0.0.1, then `ray job submit -- python
-m dapo_megatron.main --config-name quickstart ...` for 2 steps (the driver finds the cluster
through RAY_ADDRESS, which Ray sets for the job)."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest

from dapo_megatron.train.parallel import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def test_ray_job_submit_runs_quickstart(tiny_assets, tmp_path):
    gcs, dash = free_port(), free_port()
    # Ray 2.60 clusters require a token; give this test cluster its own, through the environment.
    env = {**os.environ, "RAY_DISABLE_USAGE_STATS": "1", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    env.pop("RAY_ADDRESS", None)
    # 5 CPUs: the 2 ranks (sharing them with the engine) + the data plane's controller and units
    subprocess.run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=5",
                    "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}"],
                   check=True, env=env, capture_output=True, timeout=180)
    out = tmp_path / "job"
    overrides = [f"model.path={tiny_assets / 'qwen3_moe'}",
                 f"data.train_files=[{tiny_assets / 'data' / 'train.parquet'}]",
                 f"data.val_files=[{tiny_assets / 'data' / 'val.parquet'}]",
                 "data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=2",
                 "data.max_response_length=12", "trainer.total_training_steps=2", "trainer.val_before_train=false",
                 f"trainer.default_local_dir={out}", "algorithm.filter_groups.enable=false"]
    try:
        job = subprocess.run([RAY, "job", "submit", f"--address=http://127.0.0.1:{dash}", "--",
                              sys.executable, "-m", "dapo_megatron.main", "--config-name", "quickstart", *overrides],
                             env=env, capture_output=True, text=True, timeout=600)
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
    logs = job.stdout + job.stderr
    assert job.returncode == 0, logs[-3000:]
    assert "succeeded" in logs and "step 2:" in logs
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
