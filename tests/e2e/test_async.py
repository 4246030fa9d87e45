"""trainer.mode=one_step_off end to end: `quickstart_async` (split placement, one training rank
and one engine) on the tiny task, three steps in this process, a checkpoint after each.

The engines generate step k + 1's batch with the weights of step k - 1 while step k trains; a
checkpoint saved while that batch waits untrained gives its prompts back to the stream.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HERE = os.path.dirname(__file__)
BATCH = 4  # prompts a step, every one kept (dynamic sampling off): the stream moves by 4 a step


@pytest.fixture(scope="module")
def one_step_off(tiny_assets, tmp_path_factory):
    import ray

    from dapo_megatron.config import load_config
    from dapo_megatron.driver.loop import run
    out = tmp_path_factory.mktemp("one_step_off") / "run"
    overrides = {
        "model.path": str(tiny_assets / "qwen3_moe"),
        "data.train_files": f"[{tiny_assets / 'data' / 'train.parquet'}]",
        "data.val_files": f"[{tiny_assets / 'data' / 'val.parquet'}]",
        "data.train_batch_size": BATCH, "data.gen_batch_size": BATCH, "rollout.n": 4,
        "actor.ppo_mini_batch_size": BATCH, "data.max_response_length": 12, "algorithm.filter_groups.enable": "false",
        "trainer.total_training_steps": 3, "trainer.save_freq": 1, "trainer.max_checkpoints_to_keep": 3,
        "trainer.test_freq": 2, "trainer.val_before_train": "false", "trainer.default_local_dir": str(out),
        "trainer.logger": "[jsonl]", "reward.custom_fn": f"{HERE}/parity_reward.py:compute_score"}
    cfg = load_config("quickstart_async", [f"{k}={v}" for k, v in overrides.items()])
    try:
        assert run(cfg) == 0
    finally:
        ray.shutdown()
    return out, [json.loads(line) for line in open(out / "metrics.jsonl")]


def _saved_position(out, step: int) -> int:
    """Prompts the step's checkpoint has taken from the stream (the rollout manager's state)."""
    common = torch.load(out / "checkpoints" / f"step_{step}" / "common.pt", weights_only=False)
    prompts = common["trainer"]["prompts"]
    return prompts["epoch"] * prompts["num_items"] + prompts["position"] - len(prompts["pushed_back"])


def test_next_batch_is_generated_one_push_behind_while_the_step_trains(one_step_off):
    out, rows = one_step_off
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the first batch came from the start weights; each later one was asked before the previous
    # step's push: one policy version behind the weights it trains
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert all("timing/trainer_wait" in r and "timing/gen" not in r for r in rows)
    assert ["timing/sync_wait" in r for r in rows] == [True, True, False]  # nothing asked past the last step
    # the batch's behaviour policy is not the proximal one: the decoupled weights are computed
    assert all("actor/is_weight_mean" in r for r in rows) and "val/acc" in rows[1]


def test_a_checkpoint_gives_the_untrained_batchs_prompts_back(one_step_off):
    """When step 1 and 2 were saved, the next step's batch had been taken from the stream already:
    the checkpoints hold the position after the batches they trained, so a resume trains those
    prompts once."""
    out, rows = one_step_off
    assert [_saved_position(out, s) for s in (1, 2, 3)] == [BATCH, 2 * BATCH, 3 * BATCH]
    assert rows[-1]["data_plane/resident_mb"] == 0
