"""The 30B launch scripts: valid bash, and each submits its own shipped config with `ray job
submit` (a stand-in `ray` on PATH records the command line; nothing is started)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dapo_megatron.config import available_configs

LAUNCH = Path(__file__).parents[2] / "launch"
# script -> (config it submits, what its model / data default to)
SCRIPTS = {
    "30B_megatron_dapo_gpu.sh": ("qwen3_30b_a3b_megatron_gpu", "models/Qwen3-30B-A3B-Base", "data/dapo-math-17k.parquet"),
    "30B_megatron_dapo_npu.sh": ("qwen3_30b_a3b_megatron_npu", "models/Qwen3-30B-A3B-Base", "data/dapo-math-17k.parquet"),
    "30B_vl_megatron_dapo_gpu.sh": ("qwen3_vl_30b_a3b_megatron_gpu", "models/Qwen3-VL-30B-A3B-Instruct",
                                    "data/geo3k/train.parquet"),
    "30B_vl_megatron_dapo_npu.sh": ("qwen3_vl_30b_a3b_megatron_npu", "models/Qwen3-VL-30B-A3B-Instruct",
                                    "data/geo3k/train.parquet"),
}
# The reference Ascend DAPO runs' environment (verl's A3 scripts, tests/data/verl).
ASCEND_ENV = ("LD_PRELOAD", "VLLM_USE_V1", "HCCL_CONNECT_TIMEOUT", "VLLM_ASCEND_ENABLE_NZ", "USE_OPTIMIZED_MODEL")


def _submit(script: str, tmp_path: Path, *overrides: str, **env: str) -> list[str]:
    """Run a launch script with a stand-in `ray`; returns the arguments `ray` was called with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / "ray_args.json"
    fake = bin_dir / "ray"
    fake.write_text(f"#!/usr/bin/env python3\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    fake.chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if k not in ("CONFIG", "MODEL", "TRAIN", "VAL", "DATA_DIR")},
           "PATH": f"{bin_dir}:{os.environ['PATH']}", **env}
    proc = subprocess.run(["bash", str(LAUNCH / script), *overrides], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(record.read_text())


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_launch_script_submits_its_config(script, tmp_path):
    assert subprocess.run(["bash", "-n", str(LAUNCH / script)]).returncode == 0
    config, model, train = SCRIPTS[script]
    assert config in available_configs()
    args = _submit(script, tmp_path, "trainer.total_training_steps=3")
    assert args[:2] == ["job", "submit"], args
    command = " ".join(args[args.index("--") + 1:])
    assert f"--config-name {config} " in command, command
    assert f"/{model} " in command and f"/{train}]" in command, command
    assert command.rstrip().endswith("trainer.total_training_steps=3"), command
    runtime_env = json.loads(args[args.index("--runtime-env-json") + 1])
    if "npu" in script:
        assert set(ASCEND_ENV) <= set(runtime_env["env_vars"]), runtime_env
        assert runtime_env["env_vars"]["VLLM_ASCEND_ENABLE_NZ"] == "0"


def test_vl_launch_reads_geo3k_from_data_dir(tmp_path):
    args = _submit("30B_vl_megatron_dapo_gpu.sh", tmp_path, DATA_DIR="/datasets", NNODES="4")
    command = " ".join(args[args.index("--") + 1:])
    assert "data.train_files=[/datasets/geo3k/train.parquet]" in command
    assert "data.val_files=[/datasets/geo3k/test.parquet]" in command and "trainer.nnodes=4" in command


def test_npu_launch_keeps_an_override_with_spaces_one_argument(tmp_path):
    """The NPU script runs its command through `bash -c` (to source CANN's environment first): each
    override is quoted again, so the job's shell splits it where the user's did."""
    args = _submit("30B_megatron_dapo_npu.sh", tmp_path, "trainer.experiment_name=run a", "trainer.save_freq=5")
    inner = args[args.index("--") + 1:]
    assert inner[:2] == ["bash", "-c"], inner
    words = subprocess.run(["bash", "-c", f"set -- {inner[2].split('python -m dapo_megatron.main', 1)[1]}; "
                            'printf "%s\\n" "$@"'], capture_output=True, text=True, check=True).stdout.splitlines()
    assert words[-2:] == ["trainer.experiment_name=run a", "trainer.save_freq=5"], words
