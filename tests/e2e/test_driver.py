"""The DAPO loop end to end on a local Ray cluster: 2 training ranks (EP2) and one vLLM-CPU engine.
Two steps, a checkpoint, then a resumed run that continues the step count and prompt position."""
from __future__ import annotations

import json
import os

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HERE = os.path.dirname(__file__)


def _cfg(tiny_assets, out_dir, steps, **extra):
    from dapo_megatron.config import load_config
    overrides = {
        "model.path": str(tiny_assets / "qwen3_moe"),
        "data.train_files": f"[{tiny_assets / 'data' / 'train.parquet'}]",
        "data.val_files": f"[{tiny_assets / 'data' / 'val.parquet'}]",
        "data.train_batch_size": 4, "data.gen_batch_size": 6, "rollout.n": 4, "actor.ppo_mini_batch_size": 2,
        "data.max_response_length": 12, "trainer.total_training_steps": steps, "trainer.save_freq": 1,
        "trainer.test_freq": 2, "trainer.val_before_train": "false", "trainer.default_local_dir": str(out_dir),
        "trainer.logger": "[console,jsonl]", "reward.custom_fn": f"{HERE}/parity_reward.py:compute_score",
        **extra}
    return load_config("quickstart", [f"{k}={v}" for k, v in overrides.items()])


def _rows(out_dir):
    return [json.loads(line) for line in open(out_dir / "metrics.jsonl")]


def test_two_steps_then_resume(tiny_assets, tmp_path):
    import ray

    from dapo_megatron.driver.loop import run
    out = tmp_path / "run"
    try:
        assert run(_cfg(tiny_assets, out, steps=2)) == 0
    finally:
        ray.shutdown()
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward/mean", "acc/mean", "response_length/mean", "actor/entropy", "actor/pg_clipfrac",
                "actor/grad_norm", "rollout/logprob_diff_max", "sampling/num_gen_batches", "timing/gen",
                "timing/update", "timing/sync", "timing/step", "val/acc"):
        assert key in rows[-1], key
    # The engine sampled with the weights the actor scored with: fp32 on both sides.
    assert all(r["rollout/logprob_diff_max"] < 1e-2 for r in rows)
    assert (out / "curves.png").exists() and os.listdir(out / "checkpoints")
    try:
        assert run(_cfg(tiny_assets, out, steps=3)) == 0
    finally:
        ray.shutdown()
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]  # resumed at step 3, not from scratch
