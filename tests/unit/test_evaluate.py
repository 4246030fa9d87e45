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
