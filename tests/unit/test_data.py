"""Prompt datasets: parquet/JSONL loading, the synthetic task, truncation modes, malformed rows."""
from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from dapo_megatron.config.schema import DataConfig
from dapo_megatron.data import synthetic
from dapo_megatron.data.dataset import DataError, PromptDataset

TASK_PROMPT_TOKENS = 32  # "<|im_start|>system\nAdd the two numbers. ... <|im_start|>assistant\n", counted by hand


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets / "tokenizer")


def load(files, tokenizer, *, max_prompt_length=64, truncation="filter", skip_bad_rows=False):
    return PromptDataset([str(f) for f in files], tokenizer, prompt_key="prompt", max_prompt_length=max_prompt_length,
                         truncation=truncation, skip_bad_rows=skip_bad_rows)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_synthetic_splits_are_deterministic_and_disjoint():
    train, val = synthetic.make_splits(seed=0)
    assert (train, val) == synthetic.make_splits(seed=0) and train != synthetic.make_splits(seed=1)[0]
    assert len(train) == 80 and len(val) == 20
    pairs = {split: {r["prompt"][1]["content"] for r in rows} for split, rows in (("train", train), ("val", val))}
    assert not pairs["train"] & pairs["val"] and len(pairs["train"] | pairs["val"]) == 100
    for content in pairs["val"]:  # the swapped sum was seen in training
        a, b = content.rstrip("=").split("+")
        assert f"{b}+{a}=" in pairs["train"]
    row = train[0]
    a, b = map(int, row["prompt"][1]["content"].rstrip("=").split("+"))
    assert row["reward_model"] == {"style": "rule", "ground_truth": str(a + b)}
    assert row["data_source"] == "tiny_add" and row["ability"] == "math"
    assert row["extra_info"] == {"index": 0, "split": "train"} and "\\boxed{}" in row["prompt"][0]["content"]


def test_parquet_and_jsonl_concatenate(tiny_assets, tokenizer, tmp_path):
    train_rows, _ = synthetic.make_splits(seed=0)
    jsonl = write_jsonl(tmp_path / "extra.jsonl", train_rows[:5] + ["   "])  # a blank line is not a row
    ds = load([tiny_assets / "data" / "train.parquet", jsonl], tokenizer)
    assert len(ds) == 85 and ds.stats == {"files": 2, "rows": 85, "kept": 85, "bad_rows": 0, "too_long": 0,
                                          "truncated": 0}
    assert [item.index for item in ds] == list(range(85))
    first, from_jsonl = ds[0], ds[80]
    assert first.messages == train_rows[0]["prompt"] and first.ground_truth == train_rows[0]["reward_model"][
        "ground_truth"]
    assert first.data_source == "tiny_add" and first.extra_info == {"index": 0, "split": "train"}
    assert first.source.endswith("train.parquet row 0") and from_jsonl.source.endswith("extra.jsonl row 0 (line 1)")
    assert from_jsonl.prompt.ids == first.prompt.ids and len(first.prompt.ids) == TASK_PROMPT_TOKENS
    text = tokenizer.apply_chat_template(first.messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(first.prompt.ids) == text


def test_from_config_reads_both_splits(tiny_assets, tokenizer):
    cfg = DataConfig(train_files=[str(tiny_assets / "data" / "train.parquet")],
                     val_files=[str(tiny_assets / "data" / "val.parquet")], max_prompt_length=64)
    assert len(PromptDataset.from_config(cfg, tokenizer, "train")) == 80
    assert len(PromptDataset.from_config(cfg, tokenizer, "val")) == 20
    with pytest.raises(DataError, match="tiny://data/x.parquet"):  # tiny:// is resolved by the caller
        PromptDataset.from_config(DataConfig(train_files=["tiny://data/x.parquet"]), tokenizer, "train")


@pytest.mark.parametrize("truncation,max_len,expected", [
    ("left", 8, "+4=<|im_end|>\n<|im_start|>assistant\n"),  # keeps the end, the generation header
    ("right", 8, "<|im_start|>system\nAdd the two numbers"),  # keeps the start
    ("filter", TASK_PROMPT_TOKENS, None),  # exactly at the limit: kept whole
    ("error", TASK_PROMPT_TOKENS, None),
])
def test_truncation_modes(tokenizer, tmp_path, truncation, max_len, expected):
    path = write_jsonl(tmp_path / "one.jsonl", [synthetic.make_row(3, 4, 0, "train")])
    ds = load([path], tokenizer, max_prompt_length=max_len, truncation=truncation)
    (item,) = ds
    assert len(item.prompt.ids) == max_len
    if expected is not None:
        assert tokenizer.decode(item.prompt.ids) == expected and ds.stats["truncated"] == 1
    else:
        assert ds.stats["truncated"] == 0


def test_filter_counts_and_error_names_row(tokenizer, tmp_path, caplog):
    long_row = synthetic.make_row(3, 4, 1, "train")
    long_row["prompt"][1]["content"] = "1+2+3+4="  # 4 tokens more than a task prompt
    path = write_jsonl(tmp_path / "mixed.jsonl", [synthetic.make_row(1, 2, 0, "train"), long_row])
    with caplog.at_level("INFO", logger="dapo_megatron.data.dataset"):
        ds = load([path], tokenizer, max_prompt_length=TASK_PROMPT_TOKENS + 3)
    assert len(ds) == 1 and ds.stats["too_long"] == 1 and ds[0].ground_truth == "3"
    assert "1 longer than data.max_prompt_length=35 (filtered)" in caplog.text
    with pytest.raises(DataError, match=r"mixed\.jsonl row 1 \(line 2\): prompt is 36 tokens.*max_prompt_length=35"):
        load([path], tokenizer, max_prompt_length=TASK_PROMPT_TOKENS + 3, truncation="error")


BAD_ROWS = [
    ({"data_source": "x", "prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"style": "rule"}},
     "ground_truth"),
    ({"data_source": "x", "prompt": "1+1=", "reward_model": {"ground_truth": "2"}}, "list of"),
    ({"data_source": "x", "prompt": [{"role": "user"}], "reward_model": {"ground_truth": "2"}}, r"prompt\[0\]"),
    ({"prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}}, "data_source"),
    ('{"data_source": "x", "prompt": [', "not valid JSON|Expecting"),
]


@pytest.mark.parametrize("bad,reason", BAD_ROWS)
def test_malformed_row_error_names_file_and_row(tokenizer, tmp_path, bad, reason):
    good = synthetic.make_row(1, 1, 0, "train")
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, bad, good])
    with pytest.raises(DataError, match=rf"bad\.jsonl row 2 \(line 3\): .*({reason}).*skip_bad_rows"):
        load([path], tokenizer)


def test_skip_bad_rows_counts(tokenizer, tmp_path):
    good = synthetic.make_row(1, 1, 0, "train")
    path = write_jsonl(tmp_path / "bad.jsonl", [good] + [bad for bad, _ in BAD_ROWS] + [good])
    ds = load([path], tokenizer, skip_bad_rows=True)
    assert len(ds) == 2 and ds.stats["bad_rows"] == len(BAD_ROWS) and ds.stats["rows"] == len(BAD_ROWS) + 2
    assert [item.index for item in ds] == [0, 1] and ds[1].source.endswith(f"row {len(BAD_ROWS) + 1} (line 7)")


def test_parquet_bad_row_and_numeric_ground_truth(tokenizer, tmp_path):
    rows = [synthetic.make_row(1, 1, 0, "train"), synthetic.make_row(2, 2, 1, "train")]
    rows[1]["reward_model"] = None
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=r"t\.parquet row 1: reward_model\.ground_truth"):
        load([path], tokenizer)
    numeric = dict(synthetic.make_row(1, 1, 0, "train"), reward_model={"ground_truth": 2})
    (item,) = load([write_jsonl(tmp_path / "n.jsonl", [numeric])], tokenizer)
    assert item.ground_truth == "2"


def test_file_errors(tokenizer, tmp_path):
    with pytest.raises(DataError, match="data file not found: .*missing.parquet.*data.train_files"):
        load([tmp_path / "missing.parquet"], tokenizer)
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"unknown data file type: .*rows\.csv.*\.parquet, \.jsonl"):
        load([tmp_path / "rows.csv"], tokenizer)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"cannot read parquet file .*broken\.parquet"):
        load([tmp_path / "broken.parquet"], tokenizer)
    with pytest.raises(DataError, match="data.train_files is empty"):
        load([], tokenizer)


def test_data_and_reward_never_import_megatron_vllm_or_ray():
    modules = ["dapo_megatron.data." + m for m in ("dataset", "sampler", "synthetic", "images", "geo3k_synth")]
    modules += ["dapo_megatron.reward." + m for m in ("pool", "manager", "serve", "client", "scorers", "geo3k")]
    code = (f"import sys, {', '.join(modules)}; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'vllm', 'ray'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
