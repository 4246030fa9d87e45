"""RewardManager: overlong shaping with hand-computed numbers, metrics, custom reward functions."""
from __future__ import annotations

import textwrap

import pytest
import torch

from dapo_megatron.config.custom_fn import load_custom_fn
from dapo_megatron.config.errors import ConfigError
from dapo_megatron.config.schema import OverlongBufferConfig, RewardConfig
from dapo_megatron.reward.manager import RewardManager

CUSTOM = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        pred = solution_str.split("=")[-1].strip()
        return {"score": 2.0 if pred == ground_truth else 0.0, "acc": pred == ground_truth, "pred": pred}

    def by_source(data_source, solution_str, ground_truth, extra_info):
        return 0.5 if data_source == "gsm8k" else -0.25 * extra_info["weight"]

    def no_score(data_source, solution_str, ground_truth, extra_info):
        return {"acc": True}

    def wrong_type(data_source, solution_str, ground_truth, extra_info):
        return "1.0"

    NOT_A_FUNCTION = 3
''')


@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return path


def test_overlong_shaping_with_the_math_pool():
    # max_response_length 20, buffer 8 -> expected 12; penalty = min(-(len - 12) / 8 * 1.0, 0).
    cfg = RewardConfig(num_workers=1, timeout_s=2.0,
                       overlong_buffer=OverlongBufferConfig(enable=True, len=8, penalty_factor=1.0, log=True))
    responses = ["Answer: 0.5", "Answer: 3", "\\boxed{\\frac{1}{2}}", "Answer: 1/2", "no answer here"]
    with RewardManager(cfg, max_response_length=20) as manager:
        out = manager(responses, ["1/2"] * 5, torch.tensor([10, 12, 16, 20, 14]))
    assert out.overlong_penalty.tolist() == [0.0, 0.0, -0.5, -1.0, -0.25]
    assert out.score.tolist() == [1.0, -1.0, 0.5, 0.0, -1.25]  # +-1 plus the penalty
    assert out.acc.tolist() == [True, False, True, True, False]
    assert out.pred == ["0.5", "3", "\\frac{1}{2}", "1/2", ""]
    assert out.reason == ["", "", "", "", "no_answer"]
    m = out.metrics
    assert m["reward/overlong_penalty_mean"] == pytest.approx(-1.75 / 5)
    assert m["reward/overlong_frac"] == pytest.approx(3 / 5)
    assert m["reward/score_mean"] == pytest.approx(-0.75 / 5)
    assert m["reward/acc_mean"] == pytest.approx(3 / 5)
    assert m["reward/no_answer_frac"] == pytest.approx(1 / 5)
    assert (m["reward/timeouts"], m["reward/refused"], m["reward/errors"]) == (0.0, 0.0, 0.0)


def test_penalty_factor_scales_and_disabled_buffer_adds_nothing(custom_file):
    lengths = [4, 9, 10]  # max 10, buffer 4 -> expected 6: exceed -2, 3, 4
    spec = f"{custom_file}:compute_score"
    on = RewardConfig(custom_fn=spec, overlong_buffer=OverlongBufferConfig(enable=True, len=4, penalty_factor=0.5))
    with RewardManager(on, max_response_length=10) as manager:
        out = manager(["x=1", "x=1", "x=2"], ["1", "1", "1"], lengths)
    assert out.overlong_penalty.tolist() == [0.0, -0.375, -0.5]
    assert out.score.tolist() == [2.0, 1.625, -0.5]
    assert "reward/overlong_frac" not in out.metrics  # overlong_buffer.log is off
    with RewardManager(RewardConfig(custom_fn=spec), max_response_length=10) as manager:
        out = manager(["x=1", "x=1", "x=2"], ["1", "1", "1"], lengths)
    assert out.overlong_penalty.tolist() == [0.0, 0.0, 0.0] and out.score.tolist() == [2.0, 2.0, 0.0]
    assert out.metrics["reward/overlong_penalty_mean"] == 0.0


def test_custom_fn_dict_and_float_results(custom_file):
    manager = RewardManager(RewardConfig(custom_fn=f"{custom_file}:compute_score"), max_response_length=100)
    out = manager(["so x = 7", "so x = 8"], ["7", "7"], [5, 5])
    assert out.score.tolist() == [2.0, 0.0] and out.acc.tolist() == [True, False] and out.pred == ["7", "8"]
    manager = RewardManager(RewardConfig(custom_fn=f"{custom_file}:by_source"), max_response_length=100)
    out = manager(["a", "b"], ["1", "1"], [5, 5], data_sources=["gsm8k", "math"],
                  extra_infos=[{"weight": 1.0}, {"weight": 2.0}])
    assert out.score.tolist() == [0.5, -0.5] and out.acc.tolist() == [True, False] and out.pred == ["", ""]


def test_custom_fn_bad_results_name_the_key(custom_file):
    for name, match in [("no_score", "without 'score'"), ("wrong_type", "must return a float or a dict")]:
        manager = RewardManager(RewardConfig(custom_fn=f"{custom_file}:{name}"), max_response_length=10)
        with pytest.raises(TypeError, match=f"reward.custom_fn.*{match}"):
            manager(["a"], ["1"], [1])


def test_custom_fn_loading_errors(custom_file, tmp_path):
    assert load_custom_fn(f"{custom_file}:compute_score")(None, "x=3", "3", None)["score"] == 2.0
    with pytest.raises(ConfigError, match=r"reward.custom_fn: 'missing' not found in .*my_reward.py; "
                                          r"callables there: \['by_source', 'compute_score'") as e:
        load_custom_fn(f"{custom_file}:missing")
    assert e.value.key == "reward.custom_fn"
    with pytest.raises(ConfigError, match="'NOT_A_FUNCTION' is a int, not a function"):
        load_custom_fn(f"{custom_file}:NOT_A_FUNCTION")
    with pytest.raises(ConfigError, match=r"reward.custom_fn: file .*nope.py not found"):
        load_custom_fn(f"{tmp_path}/nope.py:compute_score")
    with pytest.raises(ConfigError, match="must be 'path/to/file.py:function'"):
        load_custom_fn(str(custom_file))
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ConfigError, match=r"importing .*broken.py failed: ModuleNotFoundError"):
        load_custom_fn(f"{broken}:compute_score")


def test_manager_rejects_mismatched_inputs_and_exclusive_keys(custom_file):
    manager = RewardManager(RewardConfig(custom_fn=f"{custom_file}:compute_score"), max_response_length=10)
    with pytest.raises(ValueError, match="2 responses, 2 ground truths, 3 response lengths"):
        manager(["a", "b"], ["1", "2"], [1, 2, 3])
    with pytest.raises(ConfigError, match="exclusive") as e:
        RewardManager(RewardConfig(custom_fn=f"{custom_file}:compute_score", service_url="http://127.0.0.1:1"),
                      max_response_length=10)
    assert e.value.key == "reward.service_url"
