"""Tiny assets: tokenizer conventions, offline reload + forward of both models, determinism, cache."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from dapo_megatron.assets import build as build_mod
from dapo_megatron.assets.__main__ import main as assets_main
from dapo_megatron.assets.build import build_assets, read_manifest, resolve_asset_path
from dapo_megatron.data import synthetic

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets / "tokenizer")


def test_layout_and_manifest(tiny_assets):
    for kind in ("qwen2", "qwen3_moe"):
        for name in MODEL_FILES:
            assert (tiny_assets / kind / name).is_file(), f"{kind}/{name}"
    assert (tiny_assets / "data" / "train.parquet").is_file() and (tiny_assets / "data" / "val.parquet").is_file()
    manifest = read_manifest(tiny_assets)
    assert manifest["asset_version"] == "tiny-v2" and manifest["warmup_steps"] == 0
    assert manifest["tokenizer"]["vocab_size"] == 512 and manifest["data"]["train_rows"] == 80
    assert set(manifest["versions"]) >= {"torch", "transformers", "tokenizers"}


def test_tokenizer_round_trip_and_digits(tokenizer):
    text = "Hello world! 1234 + 56 = \\boxed{1290}\n\tünïcode ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 512
    for number in ("0", "7", "12", "9081", "1000000"):
        tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(number, add_special_tokens=False))
        assert tokens == list(number), f"{number!r} -> {tokens}"


def test_special_tokens_and_ids(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids)[0] == "<|im_start|>"
    assert ids[-2:] == [tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi", add_special_tokens=False)


def test_chat_template_is_qwen_chatml(tokenizer):
    messages = synthetic.prompt_messages(3, 4)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nAdd the two numbers. Put the final answer in \\boxed{}.<|im_end|>\n"
                    "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n")
    without_header = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert text == without_header + "<|im_start|>assistant\n"
    # No system message: Qwen's default one is inserted.
    user_only = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert user_only.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    # Every task prompt tokenizes to the same length, well under the quickstart's 64.
    lengths = {len(tokenizer.encode(tokenizer.apply_chat_template(synthetic.prompt_messages(a, b), tokenize=False,
                                                                  add_generation_prompt=True)))
               for a, b in synthetic.addition_pairs()}
    assert lengths == {32}


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_moe"])
def test_models_reload_offline_and_run(tiny_assets, kind):
    model_dir = tiny_assets / kind
    tok = AutoTokenizer.from_pretrained(model_dir)  # the model dir is self-contained
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == kind and config.vocab_size == len(tok)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tok.pad_token_id, tok.eos_token_id, tok.pad_token_id)
    gen = GenerationConfig.from_pretrained(model_dir)
    assert gen.eos_token_id == [tok.eos_token_id, tok.pad_token_id] and gen.pad_token_id == tok.pad_token_id
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    text = tok.apply_chat_template(synthetic.prompt_messages(2, 5), add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def test_same_seed_same_bytes_and_cache(tiny_assets, tmp_path, capsys):
    seed, steps = read_manifest(tiny_assets)["seed"], read_manifest(tiny_assets)["warmup_steps"]
    other = build_assets(tmp_path / "again", seed=seed, warmup_steps=steps,
                         log=lambda _msg: None)
    for rel in [f"{kind}/{name}" for kind in ("qwen2", "qwen3_moe") for name in MODEL_FILES] + [
            "tokenizer/tokenizer.json", "data/train.parquet", "data/val.parquet"]:
        assert (other / rel).read_bytes() == (tiny_assets / rel).read_bytes(), rel
    # Cache hit: same settings -> nothing is rebuilt, files keep their mtime.
    stamp = (other / "qwen3_moe" / "model.safetensors").stat().st_mtime_ns
    messages = []
    assert build_assets(other, seed=seed, warmup_steps=steps,
                        log=messages.append) == other
    assert "up to date" in messages[0]
    assert (other / "qwen3_moe" / "model.safetensors").stat().st_mtime_ns == stamp
    # The CLI takes the same path.
    assets_main(["build", "--out", str(other), "--seed", str(seed),
                 "--warmup-steps", str(steps)])
    assert "qwen3_moe" in json.loads(capsys.readouterr().out.split("\n", 1)[1])
    # Other settings: refuse without force, rebuild with it (and a different seed gives other weights).
    with pytest.raises(FileExistsError, match="--force"):
        build_assets(other, seed=seed + 1, warmup_steps=steps)
    build_assets(other, seed=seed + 1, warmup_steps=steps, force=True,
                 log=lambda _msg: None)
    assert read_manifest(other)["seed"] == seed + 1
    assert (other / "qwen2/model.safetensors").read_bytes() != (tiny_assets / "qwen2/model.safetensors").read_bytes()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_resolve_asset_path(tiny_assets, monkeypatch, tmp_path):
    monkeypatch.setenv("DAPO_MEGATRON_ASSETS", str(tiny_assets))
    assert resolve_asset_path("tiny://qwen3_moe") == str(tiny_assets / "qwen3_moe")
    assert resolve_asset_path("tiny://data/train.parquet") == str(tiny_assets / "data" / "train.parquet")
    assert resolve_asset_path("/some/where/model") == "/some/where/model"
    with pytest.raises(FileNotFoundError, match="tiny://qwen3_moe/nothing.*have:"):
        resolve_asset_path("tiny://qwen3_moe/nothing")


def test_an_unknown_name_is_refused_before_a_first_build(monkeypatch, tmp_path, capsys):
    """On a machine that never built the assets, a typo fails at once, naming the valid names;
    it once built the whole bundle first (1-4 minutes) and only then said the name was not in it."""
    monkeypatch.setenv("DAPO_MEGATRON_ASSETS", str(tmp_path / "cache"))
    monkeypatch.setattr(build_mod, "build_assets", lambda *a, **k: pytest.fail("built the bundle for a typo"))
    with pytest.raises(FileNotFoundError, match="tiny://llama: no tiny asset.*qwen3_moe.*geo3k.*tools/"):
        resolve_asset_path("tiny://llama")
    assert "first time" not in capsys.readouterr().err and not (tmp_path / "cache").exists()


def test_resolve_builds_on_first_use(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setenv("DAPO_MEGATRON_ASSETS", str(tmp_path / "cache"))

    def fake_build(out, **kwargs):  # the real build is covered above; here only the first-use path
        calls.append(out)
        (out / "data").mkdir(parents=True)
        (out / "data" / "train.parquet").write_text("x")
        (out / "manifest.json").write_text("{}")
        return out
    monkeypatch.setattr(build_mod, "build_assets", fake_build)
    assert resolve_asset_path("tiny://data/train.parquet") == str(tmp_path / "cache" / "data" / "train.parquet")
    err = capsys.readouterr().err
    assert "first time" in err and "built the tiny assets in" in err
    resolve_asset_path("tiny://data/train.parquet")
    assert calls == [tmp_path / "cache"]
