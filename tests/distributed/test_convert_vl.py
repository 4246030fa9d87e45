"""The converter and the verify tool on the tiny Qwen3-VL-MoE (assets.models.TINY_VL_MOE):
HF -> Megatron dist checkpoint -> HF at another layout is bit-exact, the experts written in the
official fused layout whichever layout came in; the saved checkpoint's logits equal HF
transformers' with and without an image; a misshapen fused expert tensor is one clear line."""
import os

import pytest
import torch

from test_convert import _assert_nothing_left, _convert, _error_line, _same_tensors, cli_here

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.background]

LOGITS_TOL = 1e-4  # fp32


def _in_layout(src: str, dst: str, layout: str) -> str:
    """A copy of the HF dir `src` with its fused expert tensors in `layout` (reshape.FUSED_LAYOUTS)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dapo_megatron.models import ModelSpec
    from dapo_megatron.weights import name_map, reshape
    shutil.copytree(src, dst)
    spec, tensors = ModelSpec.from_pretrained(src), load_file(os.path.join(src, "model.safetensors"))
    for name, (_, (rows, cols)) in name_map.fused_experts(spec).items():
        if reshape.fused_experts_layout(tensors[name].shape, spec.num_experts, rows, cols) != layout:
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory):
    """The same weights with the fused experts as transformers 5.19's save_pretrained writes them
    ("rows": [E, 2I, H], [E, H, I]) and as official checkpoints hold them ([E, H, 2I], [E, I, H])."""
    from dapo_megatron.assets.models import build_tiny_vl_model
    root = tmp_path_factory.mktemp("vl")
    saved = build_tiny_vl_model(str(root / "saved"))
    return {layout: _in_layout(saved, str(root / layout), layout) for layout in ("rows", "official")}


@pytest.fixture(scope="module")
def vl_ckpt(vl_dirs, tmp_path_factory):
    """hf-to-mcore of transformers' save at TP2 x EP2 (2 ranks: the experts spread over the TP ranks)."""
    ckpt = tmp_path_factory.mktemp("vl_mcore") / "mcore"
    proc = _convert("hf-to-mcore", "--hf-dir", vl_dirs["rows"], "--out", ckpt, "--tp", 2, "--ep", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ckpt


def test_the_two_layouts_hold_the_same_weights(vl_dirs):
    from dapo_megatron.weights import HFCheckpoint
    rows, official = HFCheckpoint(vl_dirs["rows"]), HFCheckpoint(vl_dirs["official"])
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert rows.shape(name) == (4, 192, 160) and official.shape(name) == (4, 160, 192)  # [E, 2I, H] / [E, H, 2I]
    assert torch.equal(rows.read(name).transpose(1, 2), official.read(name))


@pytest.mark.parametrize("load", [["--pp", 2], ["--ep", 2]])
def test_round_trip_writes_the_official_layout(vl_dirs, vl_ckpt, tmp_path, load):
    back = tmp_path / "hf_back"
    proc = _convert("mcore-to-hf", "--ckpt", vl_ckpt, "--out", back, "--shard-mb", 1, *load)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_tensors(vl_dirs["official"], str(back))
    from checkpoint_tools.tables import inspect
    assert "visual.merger.linear_fc2.weight" in inspect(str(vl_ckpt))
    assert "model.visual.merger.linear_fc2.weight" in inspect(str(back))


def test_official_layout_in_and_out_at_tp2(vl_dirs, tmp_path):
    """The official layout loads too (TP2 with sequence parallel, the tower replicated) and comes back unchanged."""
    ckpt, back = tmp_path / "mcore", tmp_path / "hf_back"
    proc = _convert("hf-to-mcore", "--hf-dir", vl_dirs["official"], "--out", ckpt, "--tp", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _convert("mcore-to-hf", "--ckpt", ckpt, "--out", back)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_tensors(vl_dirs["official"], str(back))


@pytest.mark.parametrize("image", [None, "1x8x12"], ids=["text", "image"])
def test_verify_tool_on_the_saved_checkpoint(vl_dirs, vl_ckpt, image):
    """checkpoint_tools/verify.py: logits of the TP2xEP2 checkpoint loaded at EP2 vs HF transformers."""
    from checkpoint_tools.verify import main
    args = ["--hf-dir", vl_dirs["official"], "--ckpt", vl_ckpt, "--ep", "2", "--random-prompts", "300", "37",
            "--tol", str(LOGITS_TOL)]
    proc = cli_here(main, *args, *(["--image", image] if image else []))
    assert proc.returncode == 0 and "OK: max |logits diff|" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    print(f"qwen3_vl_moe verify ({image or 'text only'}): {proc.stdout.strip().splitlines()[-1]}")


def test_a_misshapen_fused_expert_tensor_is_one_line(vl_dirs, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    bad, name = tmp_path / "bad", "model.language_model.layers.2.mlp.experts.down_proj"
    shutil.copytree(vl_dirs["official"], bad)
    tensors = load_file(bad / "model.safetensors")
    tensors[name] = tensors[name][:, :64].contiguous()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out" / "mcore"
    out.parent.mkdir()
    proc = _convert("hf-to-mcore", "--hf-dir", bad, "--out", out, "--ep", 2)
    assert proc.returncode == 2
    line = _error_line(proc)
    assert name in line and "[4, 64, 160]" in line and "[4, 96, 160]" in line, line
    _assert_nothing_left(str(out))


@pytest.mark.parametrize("layout", [dict(tp=2, ep=2), dict(pp=2)], ids=["tp2xep2", "pp2"])
def test_exports_equal_the_file_and_the_sync_sends_each_tensor_once(vl_dirs, layout):
    """In-process export (no dist checkpoint): the converter's (fused experts) equals the official
    file on every rank of a stage; the weight sync's per-expert tensors, over all ranks, are every
    tensor the tables name exactly once (the tower from the first stage's TP rank 0 only)."""
    from collections import Counter

    from vl_jobs import vl_exports

    from dapo_megatron.models import ModelSpec
    from dapo_megatron.train.parallel import run_workers
    from dapo_megatron.weights import HFCheckpoint, name_map
    hf = vl_dirs["official"]
    parallel = {"tp": 1, "pp": 1, "ep": 1, "etp": 1, **layout}
    per_rank = run_workers(vl_exports, 2, hf, parallel, timeout_s=300)
    assert [b for r in per_rank for mode in r.values() for b in mode["bad"]] == []
    assert set().union(*(r["gather"]["names"] for r in per_rank)) == HFCheckpoint(hf).keys()
    sent = Counter(n for r in per_rank for n in r["sent"]["names"])
    wire = name_map.expected_hf_shapes(ModelSpec.from_pretrained(hf), files=False)
    assert set(sent) == set(wire) and set(sent.values()) == {1}
    if parallel["ep"] > 1:  # each EP rank sends only its own experts
        experts = [{n for n in r["sent"]["names"] if ".experts." in n} for r in per_rank]
        assert all(0 < len(e) < len([n for n in wire if ".experts." in n]) for e in experts)
