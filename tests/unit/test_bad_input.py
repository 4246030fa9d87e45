"""Bad input of every class a run reads gives exit code 2 and exactly one `error:` line naming the
key, file or row, before Ray or any worker starts (no traceback, nothing half-started)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


def _base(tiny_assets) -> list[str]:
    return [f"model.path={tiny_assets / 'qwen3_moe'}", f"data.train_files=[{tiny_assets / 'data' / 'train.parquet'}]",
            f"data.val_files=[{tiny_assets / 'data' / 'val.parquet'}]"]


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def _main(capsys, *overrides) -> str:
    """Run the entry point in this process (the failure comes before Ray); its one error line."""
    from dapo_megatron.main import main
    capsys.readouterr()
    assert main(["--config-name", "quickstart", *overrides]) == 2
    return _error_line(capsys.readouterr().err)


def _model_copy(tiny_assets, tmp_path, edit=None) -> str:
    out = tmp_path / "model"
    shutil.copytree(tiny_assets / "qwen3_moe", out)
    if edit:
        edit(out)
    return str(out)


def _bad_rows(tiny_assets, tmp_path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()
    rows[3]["prompt"] = [{"role": "user", "content": None}]  # a row whose message has no text
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_malformed_data_row_is_one_line_from_the_command(tiny_assets, tmp_path):
    path = _bad_rows(tiny_assets, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "dapo_megatron.main", "--config-name", "quickstart",
                           *_base(tiny_assets), f"data.train_files=[{path}]"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _error_line(proc.stderr)
    assert f"{path} row 3" in line and "data.skip_bad_rows" in line


def _truncate_weights(d):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])


def _drop_tensor(d):
    from safetensors.torch import load_file, save_file
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.mlp.gate.weight"]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})


def _config(**changes):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


def _no_tokenizer(d):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (d / name).unlink()


# class -> (model edit, what the error line must name besides the key)
MODEL_CASES = {
    "unreadable weights": (_truncate_weights, "model.safetensors"),
    "missing tensor": (_drop_tensor, "model.layers.1.mlp.gate.weight"),
    "unsupported model type": (_config(model_type="llama"), "llama"),
    "no tokenizer": (_no_tokenizer, "tokenizer"),
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_bad_model_dir_is_one_line(case, tiny_assets, tmp_path, capsys):
    edit, named = MODEL_CASES[case]
    model = _model_copy(tiny_assets, tmp_path, edit)
    line = _main(capsys, *_base(tiny_assets), f"model.path={model}")
    assert named in line and model in line, line


REWARD_FILES = {
    "syntax error": ("def compute_score(:\n", "importing"),
    "no such function": ("def other(*a):\n    return 0.0\n", "'compute_score'"),
}


@pytest.mark.parametrize("case", list(REWARD_FILES))
def test_bad_custom_reward_is_one_line(case, tiny_assets, tmp_path, capsys):
    source, named = REWARD_FILES[case]
    path = tmp_path / "reward.py"
    path.write_text(source)
    line = _main(capsys, *_base(tiny_assets), f"reward.custom_fn={path}:compute_score")
    assert "reward.custom_fn" in line and str(path) in line and named in line, line


@pytest.mark.parametrize("case", ["missing", "an HF model", "a run's checkpoints"])
def test_bad_load_checkpoint_is_one_line(case, tiny_assets, tmp_path, capsys):
    """model.load_checkpoint must be a Megatron dist checkpoint (a step_<N> folder, or a converted
    model); anything else is one line naming the key before Ray starts."""
    path = {"missing": tmp_path / "nowhere", "an HF model": tiny_assets / "qwen3_moe", "a run's checkpoints": tmp_path}[case]
    (tmp_path / "latest").write_text("step_2")
    line = _main(capsys, *_base(tiny_assets), f"model.load_checkpoint={path}")
    named = {"missing": "does not exist", "an HF model": "not a Megatron dist checkpoint",
             "a run's checkpoints": "step_<N>"}[case]
    assert "model.load_checkpoint" in line and str(path) in line and named in line, line
