"""The tiny bundles' pinned CPU kernels and checksums (assets/kernels.py, assets/build.py,
assets/compare.py): the same bytes on a smaller CPU, a changed byte in one line."""
from __future__ import annotations

import shutil

import pytest
import torch

from dapo_megatron.assets import build as build_mod
from dapo_megatron.assets import compare, kernels
from dapo_megatron.assets.build import AssetError, build_assets, read_manifest, resolve_asset_path
from tests.conftest import TEST_ASSETS_SEED


def test_a_build_runs_in_a_process_with_the_pins_and_records_its_bytes(tiny_assets, tmp_path):
    """tiny_assets came from this (unpinned) test process: its build ran in a child started with
    the pins, whose torch ran its portable kernels; the manifest's checksum is its files'. A
    native build here runs on this process's kernels and says so."""
    manifest = read_manifest(tiny_assets)
    assert manifest["kernels"] == "pinned" and manifest["kernel_settings"] == kernels.PINNED
    assert manifest["cpu_capability"] == "DEFAULT"
    assert manifest["checksum"] == kernels.checksum(tiny_assets)
    assert {"qwen3_moe/model.safetensors", "data/train.parquet", "tokenizer/tokenizer.json"} <= \
        set(manifest["checksum"]["files"])
    native = build_assets(tmp_path / "native", seed=TEST_ASSETS_SEED, warmup_steps=0, kernels="native",
                          log=lambda _msg: None)
    assert read_manifest(native)["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "kernel_settings" not in read_manifest(native)
    with pytest.raises(ValueError, match="kernels='fast': one of pinned, native"):
        build_assets(tmp_path / "typo", warmup_steps=0, kernels="fast")


def test_a_changed_byte_in_a_bundle_is_one_line_naming_the_file(tiny_assets, tmp_path, monkeypatch):
    copy = tmp_path / "assets"
    shutil.copytree(tiny_assets, copy)
    monkeypatch.setenv("DAPO_MEGATRON_ASSETS", str(copy))
    assert resolve_asset_path("tiny://qwen3_moe") == str(copy / "qwen3_moe")  # as built: fine
    weights = copy / "qwen2" / "model.safetensors"
    original = weights.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    (copy / "manifest.json").touch()  # a new stamp: checked again, as a new process would
    with pytest.raises(AssetError) as err:
        resolve_asset_path("tiny://data/train.parquet")  # any name of the bundle
    line = str(err.value)
    assert "\n" not in line and f"{weights} changed since its bundle was built" in line
    assert f"build --bundle text --out {copy} --force" in line
    weights.write_bytes(original)
    (copy / "tokenizer" / "tokenizer.json").unlink()
    assert "tokenizer.json is missing" in kernels.changed_file(copy, read_manifest(copy)["checksum"]["files"])


def test_a_default_build_unlike_the_recorded_one_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """The recipe's recorded sha256 is checked for its own seed and steps only (here made 0, so
    that a random-init build stands for it), in the process that has the pins."""
    monkeypatch.setattr(build_mod, "DEFAULT_WARMUP_STEPS", 0)
    for key, value in kernels.PINNED.items():  # this process stands for the pins' child
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(build_mod.RECORDED_SHA256, "text", "0" * 64)
    out = build_assets(tmp_path / "a", seed=build_mod.DEFAULT_SEED, warmup_steps=0, log=lambda _msg: None)
    lines = capsys.readouterr().err.strip().splitlines()
    built = read_manifest(out)["checksum"]["sha256"]
    assert len(lines) == 1 and lines[0].startswith(f"warning: the text bundle built in {out} is sha256 {built[:12]}")
    assert "its recipe recorded 000000000000" in lines[0]
    monkeypatch.setitem(build_mod.RECORDED_SHA256, "text", built)
    build_assets(tmp_path / "b", seed=build_mod.DEFAULT_SEED, warmup_steps=0, log=lambda _msg: None)
    assert capsys.readouterr().err == ""


@pytest.mark.background  # eight builds of one core (~3 min): beside the phases
def test_pinned_builds_are_the_same_on_a_smaller_cpu_and_native_ones_follow_it(tmp_path):
    """The compare tool on a 2-step prefix of each warm-up: pinned, the machine as it is and told
    it is a smaller CPU build the same files in all three bundles; unpinned (the text bundle), the
    weights differ wherever this CPU runs more than torch's portable kernels."""
    results = compare.compare(["text", "tools", "vl"], work=tmp_path, warmup_steps=2,
                              settings=("pinned", "pinned, smaller CPU"), log=lambda _msg: None)
    for bundle in ("text", "tools", "vl"):
        assert results[bundle]["pinned_differs_in"] == [], results[bundle]
    for bundle in ("text", "tools", "vl"):
        manifest = read_manifest(tmp_path / f"{bundle}-pinned-smaller-CPU")
        assert manifest["cpu_capability"] == "DEFAULT" and manifest["warmup_steps"] == 2
    native = compare.compare(["text"], work=tmp_path, warmup_steps=2, settings=("native", "native, smaller CPU"),
                             log=lambda _msg: None)["text"]
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        assert {"qwen2/model.safetensors", "qwen3_moe/model.safetensors"} <= set(native["native_differs_in"]), native
        assert "tokenizer/tokenizer.json" not in native["native_differs_in"]  # no float kernel in it
