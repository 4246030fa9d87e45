"""A rollout engine that does not start (vLLM refuses its arguments) is one `error:` line naming
the config keys, from `python -m dapo_megatron.main` and `python -m dapo_megatron.evaluate` alike,
not Ray's ActorDiedError wrapping vLLM's traceback, and nothing restarts (a restart would fail the
same way). (A file missing from the model is found before any engine starts: `main` checks the
checkpoint's files, `evaluate` and `convert` theirs: tests/unit/test_bad_input.py.)

Marked background: two commands, each starting a Ray of its own and an engine that stops at once."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.background]

# below max_num_seqs (rollout.max_concurrent_per_engine: 64): vLLM's SchedulerConfig refuses it
BAD = "rollout.max_num_batched_tokens=8"
CAUSE = "the rollout engine did not start: max_num_batched_tokens (8) must be greater than or equal to max_num_seqs (64)"


def test_an_engine_that_does_not_start_is_one_line_naming_the_keys(tiny_assets, tmp_path):
    val = str(tiny_assets / "data" / "val.parquet")
    env = {**os.environ, "RAY_ADDRESS": "local"}  # a Ray of each command's own, as a user's
    evaluate = [sys.executable, "-m", "dapo_megatron.evaluate", "--model", str(tiny_assets / "qwen3_moe"), "--data",
                val, "--config-name", "quickstart", "--out", str(tmp_path / "eval"), BAD]
    main = [sys.executable, "-m", "dapo_megatron.main", "--config-name", "quickstart",
            f"model.path={tiny_assets / 'qwen3_moe'}", f"data.train_files=[{tiny_assets / 'data' / 'train.parquet'}]",
            f"data.val_files=[{val}]", f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.max_restarts=1",
            "rollout.max_engine_restarts=1", BAD]
    for cmd, output in ((evaluate, str(tmp_path / "eval" / "engine-*.log")), (main, str(tmp_path / "run" / "logs"))):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
        assert CAUSE in errors[0] and "rollout.max_num_batched_tokens, rollout.max_concurrent_per_engine" in errors[0]
        assert "Traceback" not in proc.stderr and "restart" not in proc.stdout, proc.stderr[-3000:]
        assert output in proc.stderr  # where vLLM's own traceback is
