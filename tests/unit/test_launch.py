"""The 30B launch scripts: valid bash, and each submits its own shipped config with `ray job
submit` (a stand-in `ray` on PATH records the command line, a listening socket stands in for the
cluster's dashboard; nothing is started). With no `ray` to be found, or no cluster at the
address, a script says so in one line."""
from __future__ import annotations

import contextlib
import json
import os
import socket
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


def _fake_ray(bin_dir: Path, record: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    fake = bin_dir / "ray"
    fake.write_text(f"#!/usr/bin/env python3\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    fake.chmod(0o755)


@contextlib.contextmanager
def _dashboard():
    """A listening socket at the address the scripts check: RAY_DASHBOARD for the run."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def _run(script: str, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k not in ("CONFIG", "MODEL", "TRAIN", "VAL", "DATA_DIR")}, **env}
    return subprocess.run(["bash", str(LAUNCH / script), *overrides], env=env, capture_output=True, text=True,
                          timeout=60)


def _submit(script: str, tmp_path: Path, *overrides: str, **env: str) -> list[str]:
    """Run a launch script with a stand-in `ray`; returns the arguments `ray` was called with."""
    record = tmp_path / "ray_args.json"
    _fake_ray(tmp_path / "bin", record)
    with _dashboard() as address:
        proc = _run(script, *overrides, **{"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
                                           "RAY_DASHBOARD": address, **env})
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


# PATH without the venv's bin: the system's tools only (bash, timeout, coreutils), no `ray`
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def test_the_venvs_ray_is_found_when_the_venv_is_not_active(tmp_path):
    """Was: `ray: command not found` outside the venv."""
    assert subprocess.run(["bash", "-c", "command -v ray"], env={"PATH": SYSTEM_PATH}).returncode != 0
    record = tmp_path / "ray_args.json"
    _fake_ray(tmp_path / "venv" / "bin", record)
    with _dashboard() as address:
        proc = _run("30B_megatron_dapo_gpu.sh", PATH=SYSTEM_PATH, VENV=str(tmp_path / "venv"), RAY_DASHBOARD=address)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(record.read_text())[:2] == ["job", "submit"]


def test_no_ray_to_be_found_is_one_line(tmp_path):
    proc = _run("30B_megatron_dapo_npu.sh", PATH=SYSTEM_PATH, VENV=str(tmp_path / "none"))
    assert proc.returncode == 2 and proc.stdout == "", proc
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: no `ray` on PATH") and "launch/setup_env.sh" in line, line


@pytest.mark.parametrize("script", ["30B_megatron_dapo_gpu.sh", "30B_megatron_dapo_npu.sh"])
def test_no_cluster_at_the_address_is_one_line(script, tmp_path):
    """Was: Ray's 15-line ConnectionError traceback from `ray job submit`. Nothing listens on a port
    just closed; the stand-in `ray` is never called."""
    record = tmp_path / "ray_args.json"
    _fake_ray(tmp_path / "bin", record)
    with _dashboard() as address:
        pass
    proc = _run(script, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", RAY_DASHBOARD=address)
    assert proc.returncode == 2 and not record.exists(), proc
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: no Ray cluster answers at RAY_DASHBOARD={address}") and "ray start --head" in line
