"""The tools quickstart end to end (multi-turn rollout, the real interpreter, DP2 actor): two
steps in early-stop mode. The model calls the tool, the tool metrics are logged, tool tokens are
out of the loss (the old-log-prob pass matches the engine on the model's tokens), and the run
checkpoints like any other."""
from __future__ import annotations

import json

import pytest

from tests.doc_runs import doc_args

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_tools_quickstart_two_steps_early_stop(tool_assets, tmp_path, capsys, local_ray):
    from dapo_megatron.main import main
    out = tmp_path / "run"
    overrides = {
        "model.path": str(tool_assets / "qwen2"),
        "data.train_files": f"[{tool_assets / 'data' / 'train.parquet'}]",
        "data.val_files": f"[{tool_assets / 'data' / 'val.parquet'}]",
        "data.train_batch_size": 4, "data.gen_batch_size": 6, "rollout.n": 4, "actor.ppo_mini_batch_size": 2,
        "algorithm.filter_groups.mode": "early_stop", "trainer.total_training_steps": 2, "trainer.save_freq": 2,
        "trainer.test_freq": 2, "trainer.val_before_train": "false", "trainer.default_local_dir": str(out),
        "trainer.logger": "[console,jsonl]",
        # CISPO with token-level truncated importance weights: the loss table's REINFORCE-style row
        "actor.policy_loss": "cispo", "actor.rollout_correction.is_level": "token"}
    assert main([*doc_args("python -m dapo_megatron.main --config-name quickstart_tools"), *[f"{k}={v}" for k, v in overrides.items()]]) == 0
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if "rollout/turns_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 1.0 < r["rollout/turns_mean"] <= 3.0 and r["rollout/tool_calls"] > 0 and r["timing/tools"] > 0
        assert r["rollout/tool_timeouts"] == 0 and "sampling/aborted_groups" in r
        # Old log-probs on the model's tokens equal the engine's: the masked tool tokens are in
        # the sequence the actor scores, exactly where the engine had them.
        assert r["rollout/logprob_diff_max"] < 1e-3
        assert 0.9 < r["actor/is_weight_mean"] <= 2.0 and r["actor/grad_norm"] > 0
        assert r["actor/is_clipfrac"] == 0.0  # fp32 on both sides: no weight reaches the cap of 2
    assert (out / "checkpoints" / "step_2").is_dir()
    assert any("val/" in k for r in rows for k in r)
    # Its validation samples 2 answers per prompt (val_kwargs.n): mean@2, pass@k, maj@k under our
    # names and verl's, and the validating step's console line shows pass@2 and maj@2.
    val = [r for r in rows if "val/acc" in r]
    assert val and all({"val/acc/mean@2", "val/pass@1", "val/pass@2", "val/maj@2"} <= set(r) for r in val), val
    assert all(r["val/pass@1"] <= r["val/pass@2"] for r in val)
    assert any(k.startswith("val-core/") and k.endswith("/acc/best@2/mean") for k in val[-1])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("step 2:"))
    assert "val/pass@2=" in line and "val/maj@2=" in line, line
