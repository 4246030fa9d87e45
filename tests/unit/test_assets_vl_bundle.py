"""The VL bundle (tiny://qwen3_vl_moe, tiny://geo3k/...): where the names resolve, its data parses
with the dataset, its model dir loads in transformers with the experts in the official layout, and
(slow) the warm-up reaches an accuracy that gives DAPO mixed groups, saved in the checkpoint."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors import safe_open

from dapo_megatron.assets import build as build_mod
from dapo_megatron.assets import vl
from dapo_megatron.assets.__main__ import main as assets_main
from dapo_megatron.assets.build import build_vl_task_assets, read_manifest, resolve_asset_path
from dapo_megatron.assets.models import TINY_VL_MOE
from dapo_megatron.assets.vl_warmup import (IGNORE_INDEX, is_correct, make_examples, model_inputs, response_text,
                                            sampled_accuracy, vl_warmup)
from dapo_megatron.data import geo3k_synth
from dapo_megatron.data.dataset import PromptDataset
from dapo_megatron.device.vision import image_token_counts, load_processor
from tests.conftest import in_pinned_process
from dapo_megatron.reward.geo3k import format_ok

# The warmed bundle's sampled accuracy (T=1) must clear this: a count guessed from its 1-6 range
# scores 1/6; after vl.WARMUP_STEPS seed 0 measures 0.27 train and 0.26 val on 144 samples each.
# Above the floor the model reads some of the picture.
ACCURACY_FLOOR = 0.2
FORMAT_FLOOR = 0.8


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """The bundle with the random-init model (no warm-up: seconds), where tiny:// looks for it
    when $DAPO_MEGATRON_ASSETS is `<tmp>/assets`."""
    root = tmp_path_factory.mktemp("vl-cold")
    build_vl_task_assets(root / "assets-vl", warmup_steps=0, log=lambda _msg: None)
    return root


@pytest.fixture(scope="module")
def processor(cold):
    return load_processor(str(cold / "assets-vl" / vl.MODEL_DIR))


def test_tiny_names_resolve_to_the_vl_bundle(cold, monkeypatch):
    monkeypatch.setenv("DAPO_MEGATRON_ASSETS", str(cold / "assets"))
    bundle = cold / "assets-vl"
    assert resolve_asset_path("tiny://qwen3_vl_moe") == str(bundle / "qwen3_vl_moe")
    assert resolve_asset_path("tiny://geo3k/train.parquet") == str(bundle / "geo3k" / "train.parquet")
    assert resolve_asset_path("tiny://geo3k/val.parquet") == str(bundle / "geo3k" / "val.parquet")
    with pytest.raises(FileNotFoundError, match="tiny://geo3k/test.parquet"):
        resolve_asset_path("tiny://geo3k/test.parquet")
    assert not (cold / "assets").exists()  # the text bundle was not built for a VL name


def test_first_use_builds_the_vl_bundle_only(monkeypatch, tmp_path):
    monkeypatch.setenv("DAPO_MEGATRON_ASSETS", str(tmp_path / "cache"))
    calls = []

    def fake_build(out, **kwargs):
        calls.append(out)
        (out / "geo3k").mkdir(parents=True)
        (out / "geo3k" / "val.parquet").write_text("x")
        (out / "manifest.json").write_text(json.dumps({"asset_version": vl.VL_VERSION}))
        return out
    monkeypatch.setattr(build_mod, "build_vl_task_assets", fake_build)
    monkeypatch.setattr(build_mod, "build_assets", lambda *a, **k: pytest.fail("built the text bundle"))
    assert resolve_asset_path("tiny://geo3k/val.parquet") == str(tmp_path / "cache-vl" / "geo3k" / "val.parquet")
    resolve_asset_path("tiny://geo3k/val.parquet")
    assert calls == [tmp_path / "cache-vl"]


def test_a_bundle_of_an_older_recipe_is_kept_with_a_warning(cold, monkeypatch):
    """A cache built by an older checkout is used as it is (a run may train from it), with a
    warning that names the command to rebuild it; the current recipe's bundle gets none."""
    import warnings
    monkeypatch.setenv("DAPO_MEGATRON_ASSETS", str(cold / "assets"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = resolve_asset_path("tiny://qwen3_vl_moe")
    monkeypatch.setattr(vl, "VL_VERSION", "vl-next")
    with pytest.warns(UserWarning, match=f"are {read_manifest(cold / 'assets-vl')['asset_version']}, this checkout's "
                      r"recipe is vl-next: rebuild them with `python -m dapo_megatron.assets build --bundle vl"):
        assert resolve_asset_path("tiny://qwen3_vl_moe") == path


def test_manifest_cache_and_cli(cold, capsys):
    bundle = cold / "assets-vl"
    manifest = read_manifest(bundle)
    assert manifest["asset_version"] == vl.VL_VERSION and manifest["warmup_steps"] == 0
    assert manifest["image_size"] == vl.IMAGE_SIZE and manifest["build_seconds"] > 0
    assert manifest["data"] == {"data_source": "hiyouga/geometry3k", "kinds": list(vl.KINDS), "train_rows": vl.N_TRAIN,
                                "val_rows": vl.N_VAL}
    # The CLI finds the same build up to date; other settings are refused without --force.
    stamp = (bundle / "qwen3_vl_moe" / "model.safetensors").stat().st_mtime_ns
    assets_main(["build", "--bundle", "vl", "--out", str(bundle), "--warmup-steps", "0"])
    assert "qwen3_vl_moe" in json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert (bundle / "qwen3_vl_moe" / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError, match="--force"):
        build_vl_task_assets(bundle, warmup_steps=5, log=lambda _msg: None)


def test_data_parses_with_the_dataset_at_the_manifests_lengths(cold, processor):
    manifest = read_manifest(cold / "assets-vl")
    low, high = manifest["models"]["qwen3_vl_moe"]["prompt_tokens"]
    assert 150 <= low <= high <= 256  # a few hundred tokens, 100 of them the image's
    kinds = Counter()
    for split, rows in (("train", vl.N_TRAIN), ("val", vl.N_VAL)):
        ds = PromptDataset([str(cold / "assets-vl" / "geo3k" / f"{split}.parquet")], processor.tokenizer,
                           prompt_key="prompt", max_prompt_length=high, truncation="error", skip_bad_rows=False,
                           image_tokens=lambda images: image_token_counts(processor.image_processor, images))
        assert len(ds) == rows and ds.stats["bad_rows"] == 0
        for item in ds:
            (image,) = item.prompt.images
            assert (image.width, image.height) == (vl.IMAGE_SIZE, vl.IMAGE_SIZE) and item.data_source == "hiyouga/geometry3k"
            kinds[item.extra_info["kind"]] += split == "train"
    assert set(kinds) == set(vl.KINDS) and min(kinds.values()) >= vl.N_TRAIN // len(vl.KINDS)


def test_cold_model_dir_loads_with_the_official_expert_layout(cold):
    check_model_dir(cold / "assets-vl" / vl.MODEL_DIR)


def train_accuracy(model_dir: str, seed: int) -> dict:
    """The build's train accuracy figure, computed again from the saved dir (in_pinned_process)."""
    from transformers import Qwen3VLMoeForConditionalGeneration
    torch.set_num_threads(1)
    processor = load_processor(model_dir)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    train = make_examples(processor, geo3k_synth.make_rows(vl.EVAL["examples"], seed, "train", vl.IMAGE_SIZE,
                                                           vl.KINDS))
    return sampled_accuracy(model, processor, train, samples_per_prompt=vl.EVAL["samples_per_prompt"],
                            temperature=1.0, max_new_tokens=vl.MAX_NEW_TOKENS, seed=seed)


def check_model_dir(model_dir):
    """Experts on disk as official checkpoints (and vLLM) have them; transformers loads the dir
    with its processor and runs a prompt of the bundle's data."""
    from transformers import Qwen3VLMoeForConditionalGeneration
    E, H, I = (TINY_VL_MOE["text_config"][k] for k in ("num_experts", "hidden_size", "moe_intermediate_size"))
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for layer in range(TINY_VL_MOE["text_config"]["num_hidden_layers"]):
            prefix = f"model.language_model.layers.{layer}.mlp.experts."
            assert f.get_slice(prefix + "gate_up_proj").get_shape() == [E, H, 2 * I]
            assert f.get_slice(prefix + "down_proj").get_shape() == [E, I, H]
    assert json.loads((model_dir / "config.json").read_text())["text_config"]["norm_topk_prob"] is True
    processor = load_processor(str(model_dir))
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    (example,) = make_examples(processor, geo3k_synth.make_rows(1, 0, "test", vl.IMAGE_SIZE))
    with torch.no_grad():
        logits = model(**model_inputs(processor, [example], train=False)).logits
    assert logits.shape[1] == len(example.prompt_ids) and torch.isfinite(logits).all()
    return model, processor


def test_reference_responses_are_short_well_formed_and_correct(processor):
    examples = make_examples(processor, geo3k_synth.make_rows(30, 0, "train", vl.IMAGE_SIZE))
    for e in examples:
        assert len(e.response_ids) <= vl.MAX_NEW_TOKENS and e.response_ids[-1] == processor.tokenizer.eos_token_id
        text = processor.tokenizer.decode(e.response_ids, skip_special_tokens=True)
        assert text == response_text(e.kind, e.answer) and format_ok(text) and is_correct(text, e.answer)
        assert not is_correct(text, str(int(e.answer) + 1))
        assert e.prompt_ids.count(TINY_VL_MOE["image_token_id"]) == (vl.IMAGE_SIZE // 16) ** 2
    batch = model_inputs(processor, examples[:3], train=True)
    assert ((batch["labels"] != IGNORE_INDEX).sum(1) == torch.tensor([len(e.response_ids) for e in examples[:3]])).all()


def test_warmup_steps_lower_the_loss(cold, processor):
    from transformers import Qwen3VLMoeForConditionalGeneration
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(cold / "assets-vl" / vl.MODEL_DIR),
                                                               dtype=torch.float32)
    examples = make_examples(processor, geo3k_synth.make_rows(12, 0, "train", vl.IMAGE_SIZE))
    losses = vl_warmup(model, processor, examples, steps=6, batch_size=4, lr=2e-3, seed=0)
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0], losses


@pytest.mark.slow
@pytest.mark.background  # ~150 s of one core, its asserts on what it computes: beside the phases
def test_warm_bundle_built_on_first_use(tmp_path_factory):
    """The real first use (~3 min): tiny://qwen3_vl_moe builds the warmed bundle, whose manifest
    accuracy clears the floor with headroom left, and the saved checkpoint IS the warmed model:
    re-sampling from the dir with the build's seed gives the manifest's accuracy again."""
    root = tmp_path_factory.mktemp("vl-warm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DAPO_MEGATRON_ASSETS", str(root / "assets"))
        model_dir = resolve_asset_path("tiny://qwen3_vl_moe")
    manifest = read_manifest(root / "assets-vl")
    stats = manifest["models"]["qwen3_vl_moe"]
    assert manifest["warmup_steps"] == vl.WARMUP_STEPS and stats["warmup_steps_taken"] == vl.WARMUP_STEPS
    assert stats["loss_last"] < 0.5 * stats["loss_first"]
    for split in ("train", "val"):
        assert stats[split]["format"] >= FORMAT_FLOOR, stats
        assert ACCURACY_FLOOR <= stats[split]["accuracy"] <= 0.8, stats  # signal, and headroom for RL
    check_model_dir(root / "assets-vl" / vl.MODEL_DIR)
    again = in_pinned_process("tests.unit.test_assets_vl_bundle:train_accuracy",
                              model_dir=str(root / "assets-vl" / vl.MODEL_DIR), seed=manifest["seed"])
    assert again == stats["train"]
    assert model_dir == str(root / "assets-vl" / vl.MODEL_DIR)


def test_built_again_the_bundle_has_the_same_bytes(cold, processor, tmp_path):
    """The bundle is meant to be the same bytes on every machine with the same torch build and CPU
    kernels (the warm-up runs on one thread, every RNG seeded): built again in a fresh folder, its
    model, tokenizer and data files are identical, and so are the weights after the same warm-up
    steps from it (the warm bundle's own path, a few steps instead of its 160)."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from dapo_megatron.assets.models import save_vl_model
    first = cold / "assets-vl"
    again = build_vl_task_assets(tmp_path / "again-vl", warmup_steps=0, log=lambda _msg: None)
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert any(f.suffix == ".safetensors" for f in files) and any(f.suffix == ".parquet" for f in files)
    for f in files:
        assert (first / f).read_bytes() == (again / f).read_bytes(), f
    examples = make_examples(processor, geo3k_synth.make_rows(8, 0, "train", vl.IMAGE_SIZE))
    weights = []
    for name in ("a", "b"):
        model = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(first / vl.MODEL_DIR), dtype=torch.float32)
        vl_warmup(model, processor, examples, steps=3, batch_size=4, lr=vl.WARMUP["lr"], seed=0)
        save_vl_model(model, str(tmp_path / name))
        weights.append((tmp_path / name / "model.safetensors").read_bytes())
    assert weights[0] == weights[1]
    assert weights[0] != (first / vl.MODEL_DIR / "model.safetensors").read_bytes()  # the steps moved it
