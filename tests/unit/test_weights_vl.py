"""Qwen3-VL-MoE's HF <-> Megatron names and layouts (no processes, no Megatron): the text part's
tables under `model.language_model.`, the vision tower copied as-is, and the experts each layer
fuses into one file tensor, in both layouts it comes in (official [E, H, 2I] / [E, I, H], and
transformers 5.19's save_pretrained [E, 2I, H] / [E, H, I]). A mapping round trip of
`torch.arange` tensors proves the loader's and the exporter's reshapes bit-exact."""
import os

import pytest
import torch

from dapo_megatron.assets.models import TINY_VL_MOE
from dapo_megatron.models import ModelSpec
from dapo_megatron.weights import name_map, reshape
from dapo_megatron.weights.hf_io import CheckpointError, HFCheckpoint

VL = "qwen3_vl_moe"
LM = "model.language_model."


def _spec() -> ModelSpec:
    return ModelSpec.from_hf(dict(model_type=VL, **TINY_VL_MOE))


def test_vl_names_resolve_to_the_text_models_megatron_names():
    pm = name_map.resolve("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", VL,
                          global_layer={0: 2, 1: 3}, expert_offset=2, tied=False)
    assert pm.kind == "gate_up" and pm.is_expert and pm.tp_dim == 0
    assert pm.hf_names == {"gate": LM + "layers.3.mlp.experts.2.gate_proj.weight",
                           "up": LM + "layers.3.mlp.experts.2.up_proj.weight"}
    pm = name_map.resolve("decoder.layers.0.self_attention.linear_qkv.weight", VL, global_layer={0: 1},
                          expert_offset=0, tied=False)
    assert pm.kind == "qkv" and pm.hf_names["k"] == LM + "layers.1.self_attn.k_proj.weight"
    for mcore, hf in (("embedding.word_embeddings.weight", LM + "embed_tokens.weight"),
                      ("decoder.final_layernorm.weight", LM + "norm.weight"), ("output_layer.weight", "lm_head.weight"),
                      ("decoder.layers.0.mlp.router.weight", LM + "layers.0.mlp.gate.weight")):
        assert name_map.resolve(mcore, VL, global_layer={0: 0}, expert_offset=0, tied=False).hf_names == {None: hf}
    tied = name_map.resolve("output_layer.weight", VL, global_layer={}, expert_offset=0, tied=True)
    assert tied.hf_names == {None: LM + "embed_tokens.weight"} and tied.is_vocab
    # the vision tower: its HF names under model.visual., replicated (no TP dim), not an expert
    pm = name_map.resolve("visual.blocks.2.mlp.linear_fc1.weight", VL, global_layer={}, expert_offset=0, tied=False)
    assert pm.hf_names == {None: "model.visual.blocks.2.mlp.linear_fc1.weight"} and pm.kind == "copy"
    assert pm.tp_dim is None and not pm.is_expert and not pm.is_vocab
    # the text tables are a prefix variant of qwen3_moe's: the same Megatron names, row for row
    text = {mc: {p: hf.replace("model.", LM, 1) for p, hf in parts.items()}
            for mc, (_, parts) in name_map.mcore_to_hf_table("qwen3_moe").items()}
    assert {mc: parts for mc, (_, parts) in name_map.mcore_to_hf_table(VL).items()} == text


def test_expected_shapes_fuse_the_experts_in_the_official_layout():
    spec = _spec()
    files, wire = name_map.expected_hf_shapes(spec), name_map.expected_hf_shapes(spec, files=False)
    h, i, e = 160, 96, 4
    assert files[LM + "layers.3.mlp.experts.gate_up_proj"] == (e, h, 2 * i)
    assert files[LM + "layers.3.mlp.experts.down_proj"] == (e, i, h)
    assert LM + "layers.3.mlp.experts.1.up_proj.weight" not in files
    assert wire[LM + "layers.3.mlp.experts.1.up_proj.weight"] == (i, h)
    assert wire[LM + "layers.0.mlp.experts.3.down_proj.weight"] == (h, i)
    assert files["model.visual.patch_embed.proj.weight"] == (64, 3, 2, 8, 8) == wire["model.visual.patch_embed.proj.weight"]
    assert files["lm_head.weight"] == (509, h) and files[LM + "embed_tokens.weight"] == (509, h)
    # per layer: 2 fused expert tensors in the files, 3 per expert on the wire
    assert len(wire) - len(files) == 4 * (3 * e - 2)
    # tied: text_config's flag (the one vLLM reads) decides; no lm_head in the files
    text = {**TINY_VL_MOE["text_config"], "tie_word_embeddings": True}
    tied = ModelSpec.from_hf(dict(model_type=VL, **{**TINY_VL_MOE, "text_config": text}))
    assert "lm_head.weight" not in name_map.expected_hf_shapes(tied) and tied.tie_word_embeddings


def _arange_checkpoint(path, spec, layout: str) -> dict:
    """Every tensor of the files, distinct arange values; fused experts written in `layout`.
    Returns the tensors in the official layout."""
    from safetensors.torch import save_file
    tensors, offset, official = {}, 0, {}
    for name, shape in sorted(name_map.expected_hf_shapes(spec).items()):
        n = torch.Size(shape).numel()
        t = (torch.arange(n, dtype=torch.float64) + offset).to(torch.float32).reshape(shape)  # exact below 2**24
        offset += n
        official[name] = t
        tensors[name] = t.transpose(1, 2).contiguous() if layout == "rows" and ".experts." in name else t
    assert offset < 1 << 24
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return official


@pytest.mark.parametrize("layout", reshape.FUSED_LAYOUTS)
@pytest.mark.parametrize("etp", [1, 2])
def test_mapping_round_trip_is_bit_exact(tmp_path, layout, etp):
    """Files -> per-expert HF tensors (as the loader reads them, split over expert-TP) -> Megatron's
    fused linear_fc1 -> back (as the exporter does) -> stacked: the official-layout tensors exactly."""
    from dapo_megatron.weights.export import _ExpertStacker
    from dapo_megatron.weights.load import UnstackedExperts, check_names, check_shapes
    spec = _spec()
    official = _arange_checkpoint(tmp_path, spec, layout)
    ckpt = HFCheckpoint(str(tmp_path))
    check_names(ckpt, spec)
    check_shapes(ckpt, spec)
    source, stacker, out = UnstackedExperts(ckpt, spec), _ExpertStacker(spec), {}
    wire = name_map.expected_hf_shapes(spec, files=False)
    for name, shape in wire.items():
        if name.endswith("gate_proj.weight"):  # an expert's linear_fc1: its gate and up, per ETP rank
            up_name = name.replace("gate_proj", "up_proj")
            rows = shape[0] // etp
            fc1 = [reshape.gate_up_to_mcore(source.read(name, 0, r * rows, (r + 1) * rows),
                                            source.read(up_name, 0, r * rows, (r + 1) * rows)) for r in range(etp)]
            parts = [reshape.gate_up_from_mcore(s) for s in fc1]
            out.update(stacker.add({name: torch.cat([p[0] for p in parts]), up_name: torch.cat([p[1] for p in parts])}))
        elif name.endswith("down_proj.weight"):  # linear_fc2: columns split over ETP
            cols = shape[1] // etp
            out.update(stacker.add({name: torch.cat([source.read(name, 1, r * cols, (r + 1) * cols)
                                                     for r in range(etp)], dim=1)}))
        elif not name.endswith("up_proj.weight"):
            assert source.shape(name) == shape
            out.update(stacker.add({name: source.read(name)}))
    stacker.check_done()
    assert out.keys() == official.keys()
    for name, t in official.items():
        assert out[name].shape == t.shape and torch.equal(out[name], t), name


def test_the_layout_is_told_by_shape_and_a_wrong_one_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from dapo_megatron.weights.load import UnstackedExperts, check_shapes
    spec = _spec()
    assert reshape.fused_experts_layout((4, 160, 192), 4, 192, 160) == "official"
    assert reshape.fused_experts_layout((4, 192, 160), 4, 192, 160) == "rows"
    assert reshape.fused_experts_layout((4, 96, 96), 4, 96, 96) == "official"  # square: as vLLM reads it
    assert reshape.fused_experts_layout((4, 160, 96), 4, 192, 160) is None
    _arange_checkpoint(tmp_path, spec, "official")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    bad = LM + "layers.2.mlp.experts.gate_up_proj"
    tensors[bad] = tensors[bad][:, :, :96].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor {bad} has shape \\[4, 160, 96\\], expected \\[4, 160, 192\\]"):
        check_shapes(HFCheckpoint(str(tmp_path)), spec)
    with pytest.raises(CheckpointError, match=bad):  # the loader names the file's tensor, not the expert's
        UnstackedExperts(HFCheckpoint(str(tmp_path)), spec).shape(LM + "layers.2.mlp.experts.1.up_proj.weight")


def test_expected_names_match_transformers_own_save(tmp_path):
    """transformers' save_pretrained (the rows layout) passes the name and shape checks; the
    tower's names and shapes are the file's."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from dapo_megatron.weights.load import check_hf_checkpoint
    d = str(tmp_path / "vl")
    Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(**TINY_VL_MOE)).save_pretrained(d)
    spec, ckpt = ModelSpec.from_pretrained(d), HFCheckpoint(d)
    expected = name_map.expected_hf_shapes(spec)
    assert set(expected) == ckpt.keys()
    fused = name_map.fused_experts(spec)
    for name, shape in expected.items():
        if name in fused:
            assert ckpt.shape(name) == (shape[0], shape[2], shape[1]), name  # transformers writes rows
        else:
            assert ckpt.shape(name) == shape, name
    check_hf_checkpoint(d, spec)
