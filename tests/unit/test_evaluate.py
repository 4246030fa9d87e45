"""`python -m dapo_megatron.evaluate`: bad input is one `error:` line before any engine starts;
the summary's table (per data_source and overall) from scored samples. The end-to-end run on a
training checkpoint rides on tests/e2e/test_driver.py's `whole` run."""
import pytest

from dapo_megatron import evaluate
from dapo_megatron.evaluate.run import render, summarize


def test_a_model_path_that_is_not_a_model_is_one_error_line(tmp_path, capsys):
    assert evaluate.main(["--model", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: --model") and "checkpoint" in err


def test_a_broken_data_file_is_one_error_line_naming_it(tiny_assets, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["1+1?"], "reward_model": [{"ground_truth": "2"}]}), bad)
    rc = evaluate.main(["--model", str(tiny_assets / "qwen3_moe"), "--data", str(bad), "--out", str(tmp_path / "o"),
                        "-cn", "quickstart"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "bad.parquet" in err and "prompt" in err, err


def test_a_model_missing_its_weights_is_one_error_line_before_any_engine(tiny_assets, tmp_path, capsys):
    """vLLM's engine would stop ~30 s in with its traceback ("Cannot find any model weights")."""
    import shutil
    model = tmp_path / "model"
    shutil.copytree(tiny_assets / "qwen3_moe", model)
    (model / "model.safetensors").unlink()
    rc = evaluate.main(["--model", str(model), "--data", str(tiny_assets / "data" / "val.parquet"),
                        "--out", str(tmp_path / "o"), "-cn", "quickstart"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and err.startswith("error: ") and str(model) in err, err
    assert not (tmp_path / "o" / "engine-0.log").exists()  # no engine started


def test_summary_per_source_and_overall():
    recs = [dict(index=i, data_source=src, answer=ans, correct=ok, length=10 * (j + 1), cut=j == 1)
            for i, src, answers in ((0, "a", [("1", True), ("2", False)]), (1, "b", [("3", False), ("3", False)]))
            for j, (ans, ok) in enumerate(answers)]
    s = summarize(recs, 2)
    a, b, everything = (s["sources"][k] for k in ("a", "b", "all"))
    assert a["avg@2"] == 0.5 and a["pass@2"] == 1 and a["maj@2"] == 1 and b["pass@2"] == 0
    assert everything["avg@2"] == 0.25 and everything["prompts"] == 2 and everything["cut"] == 0.5
    assert everything["response_length"] == 15 and s["maj_method"] == "exact"
    table = render(s)
    assert table.splitlines()[-2].startswith("all") and "pass@2" in table.splitlines()[0]


@pytest.mark.parametrize("path", ["tiny://no_such_model"])
def test_an_unknown_tiny_name_is_one_error_line(path, tmp_path, capsys):
    assert evaluate.main(["--model", path, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error:")


def _load(argv, capsys):
    from dapo_megatron.evaluate.run import load
    cfg, *_ = load(evaluate.parse_args(argv))
    return cfg, capsys.readouterr().err.strip().splitlines()


def test_a_configs_lengths_fit_the_model_and_say_so(tiny_assets, tmp_path, capsys):
    """Was: dapo.yaml's 2048 + 20480 tokens on a 1024-position model, and vLLM's pydantic traceback
    a minute later. A user's own lengths beyond the model stop in one line naming the key."""
    argv = ["--model", str(tiny_assets / "qwen3_moe"), "--data", str(tiny_assets / "data" / "val.parquet"),
            "--out", str(tmp_path / "out")]
    cfg, err = _load(argv, capsys)  # -cn dapo, the default
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (512, 512)
    assert cfg.reward.overlong_buffer.enable and cfg.reward.overlong_buffer.len == 4096 * 512 // 20480
    assert err == ["lengths: data.max_prompt_length=512 + data.max_response_length=512 (reward.overlong_buffer.len="
                   "102, the same share of it), fitted to the model's max_position_embeddings (1024); set them to "
                   "choose"], err
    argv += ["reward.overlong_buffer.len=100"]
    assert evaluate.main([*argv, "data.max_prompt_length=256", "data.max_response_length=1000"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == ("error: data.max_prompt_length + data.max_response_length = 1256 exceeds the model's "
                    "max_position_embeddings (1024)"), line  # training's rule, before any engine
    cfg, err = _load([*argv, "data.max_prompt_length=256", "data.max_response_length=768"], capsys)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length, err) == (256, 768, [])


def test_n_samples_of_greedy_decoding_say_they_are_one(tiny_assets, tmp_path, capsys):
    """Was: avg@4 = pass@4 = maj@4 printed with nothing saying the validation was greedy (the
    quickstart's was; the VL demo's still is)."""
    argv = ["--model", str(tiny_assets / "qwen3_moe"), "--data", str(tiny_assets / "data" / "val.parquet"),
            "--out", str(tmp_path / "out"), "-cn", "quickstart"]
    _, err = _load([*argv, "--n", "4", "--temperature", "0"], capsys)
    assert len(err) == 1 and err[0].startswith("note: greedy decoding") and "--temperature 1.0" in err[0], err
    assert _load([*argv, "--n", "4"], capsys)[1] == []  # the quickstart samples its validation
    assert _load([*argv, "--n", "1", "--temperature", "0"], capsys)[1] == []  # n = 1: nothing to say
