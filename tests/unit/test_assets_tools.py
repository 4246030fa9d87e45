"""The tool task's bundle (assets/tools.py) as the tests and the tool demo get it: warmed up until
the model calls the interpreter and answers from its output often enough for DAPO's groups to
mix, and saved as that model. (slow: the real build, ~1 min, which launch/run_tests.sh starts beside
the unit phase; the end-to-end phase reuses it.)"""
import json

import pytest
import torch

from dapo_megatron.assets import tools
from dapo_megatron.data import tool_task

pytestmark = pytest.mark.slow


def test_tool_bundle_stops_at_its_target_and_saves_the_warmed_model(tool_assets, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    manifest = json.loads((tool_assets / "manifest.json").read_text())
    stats = manifest["models"][tools.MODEL_KIND]
    assert 0 < stats["warmup_steps_taken"] < tools.WARMUP_STEPS, stats  # the accuracy target stopped it
    assert stats["loss_last"] < 0.1 * stats["loss_first"], stats
    model_dir = tool_assets / tools.MODEL_KIND
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # The check that stopped the warm-up, again on the saved model: the same pairs and seed.
    train_pairs, _ = tool_task.split_pairs(manifest["seed"])
    got = tools.tool_accuracy(model, tokenizer, train_pairs[:32], seed=manifest["seed"])
    assert got["accuracy"] >= tools.TARGET_ACCURACY and got["calls_ran"] >= 0.5, got
