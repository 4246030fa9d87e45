"""The tool task's bundle (assets/tools.py) as the tests and the tool demo get it: warmed up until
the model calls the interpreter and answers from its output often enough for DAPO's groups to
mix, and saved as that model. (slow: the real build, ~1 min, which launch/run_tests.sh starts beside
the unit phase; the end-to-end phase reuses it.)"""
import json

import pytest
import torch

from dapo_megatron.assets import tools
from dapo_megatron.data import tool_task
from tests.conftest import in_pinned_process

pytestmark = pytest.mark.slow


def test_tool_bundle_stops_at_its_target_and_saves_the_warmed_model(tool_assets):
    manifest = json.loads((tool_assets / "manifest.json").read_text())
    stats = manifest["models"][tools.MODEL_KIND]
    assert 0 < stats["warmup_steps_taken"] < tools.WARMUP_STEPS, stats  # the accuracy target stopped it
    assert stats["loss_last"] < 0.1 * stats["loss_first"], stats
    # The check that stopped the warm-up, again on the saved model: the same pairs and seed, on the
    # build's kernels.
    got = in_pinned_process("tests.unit.test_assets_tools:check_accuracy",
                            model_dir=str(tool_assets / tools.MODEL_KIND), seed=manifest["seed"])
    assert got["accuracy"] >= tools.TARGET_ACCURACY and got["calls_ran"] >= 0.5, got


def check_accuracy(model_dir: str, seed: int) -> dict:
    """The warm-up's stop check on the saved model (in_pinned_process)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_pairs, _ = tool_task.split_pairs(seed)
    return tools.tool_accuracy(model, tokenizer, train_pairs[:32], seed=seed)
