"""Pure tests of the HF <-> Megatron name tables and reshapes (no processes, no Megatron)."""
import pytest
import torch

from dapo_megatron.models.registry import archs
from dapo_megatron.weights import name_map, reshape


def test_qkv_interleave_round_trip_and_layout():
    groups, q_per_group, d, hidden = 2, 3, 4, 5
    q = torch.arange(groups * q_per_group * d * hidden).reshape(-1, hidden)  # [heads*D, H]
    k = 1000 + torch.arange(groups * d * hidden).reshape(-1, hidden)  # [G*D, H]
    v = 2000 + torch.arange(groups * d * hidden).reshape(-1, hidden)
    qkv = reshape.qkv_to_mcore(q, k, v, groups, d)
    assert qkv.shape == (groups * (q_per_group + 2) * d, hidden)
    grouped = qkv.reshape(groups, q_per_group + 2, d, hidden)  # [G, q_per_group+2, D, H]
    assert torch.equal(grouped[1, :q_per_group], q.reshape(groups, q_per_group, d, hidden)[1])
    assert torch.equal(grouped[1, q_per_group], k.reshape(groups, d, hidden)[1])
    assert torch.equal(grouped[0, q_per_group + 1], v.reshape(groups, d, hidden)[0])
    for a, b in zip(reshape.qkv_from_mcore(qkv, groups, d), (q, k, v)):
        assert torch.equal(a, b)


def test_qkv_bias_and_tp_shards_concatenate():
    groups, d = 4, 2
    q, k, v = torch.arange(16.), 100 + torch.arange(8.), 200 + torch.arange(8.)  # biases [rows]
    full = reshape.qkv_to_mcore(q, k, v, groups, d)
    # A TP rank owning groups [2, 4) holds exactly the contiguous second half of the fused tensor.
    shard = reshape.qkv_to_mcore(q[8:], k[4:], v[4:], 2, d)
    assert torch.equal(shard, full[full.shape[0] // 2:])


def test_gate_up_round_trip():
    gate, up = torch.arange(12).reshape(3, 4), 100 + torch.arange(12).reshape(3, 4)
    fc1 = reshape.gate_up_to_mcore(gate, up)
    assert torch.equal(fc1[:3], gate) and torch.equal(fc1[3:], up)
    g, u = reshape.gate_up_from_mcore(fc1)
    assert torch.equal(g, gate) and torch.equal(u, up)


@pytest.mark.parametrize("experts_per_rank,ep", [(4, 1), (2, 2), (1, 4)])
def test_expert_ids_round_trip(experts_per_rank, ep):
    seen = set()
    for ep_rank in range(ep):
        for local in range(experts_per_rank):
            g = reshape.global_expert_id(local, ep_rank, experts_per_rank)
            assert reshape.local_expert_id(g, experts_per_rank) == (ep_rank, local)
            seen.add(g)
    assert seen == set(range(experts_per_rank * ep))


def test_vocab_pad_and_trim():
    from dapo_megatron.models import padded_vocab_size
    assert padded_vocab_size(509, 1) == 512 and padded_vocab_size(509, 2) == 512
    assert padded_vocab_size(151936, 2) == 152064 and padded_vocab_size(512, 4) == 512
    t = torch.arange(10.).reshape(5, 2)
    padded = reshape.pad_vocab(t, 8)
    assert padded.shape == (8, 2) and padded[5:].abs().sum() == 0
    assert torch.equal(reshape.trim_vocab(padded, 5), t)
    with pytest.raises(ValueError):
        reshape.pad_vocab(t, 4)


def test_shard_range():
    assert [reshape.shard_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError):
        reshape.shard_range(7, 0, 2)


def test_resolve_maps_local_ids_to_global():
    pm = name_map.resolve("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", "qwen3_moe",
                          global_layer={0: 2, 1: 3}, expert_offset=2, tied=False)
    assert pm.kind == "gate_up" and pm.is_expert
    assert pm.hf_names == {"gate": "model.layers.3.mlp.experts.2.gate_proj.weight",
                           "up": "model.layers.3.mlp.experts.2.up_proj.weight"}
    pm = name_map.resolve("decoder.layers.0.self_attention.linear_qkv.bias", "qwen2",
                          global_layer={0: 5}, expert_offset=0, tied=False)
    assert pm.kind == "qkv" and pm.hf_names["k"] == "model.layers.5.self_attn.k_proj.bias"
    pm = name_map.resolve("output_layer.weight", "qwen2", global_layer={}, expert_offset=0, tied=True)
    assert pm.hf_names == {None: "model.embed_tokens.weight"} and pm.is_vocab


def test_resolve_te_alias_and_unknown_names():
    pm = name_map.resolve("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "qwen3",
                          global_layer={0: 0}, expert_offset=0, tied=False)
    assert pm.hf_names == {None: "model.layers.0.input_layernorm.weight"}
    with pytest.raises(KeyError, match="decoder.layers.0.mystery.weight"):
        name_map.resolve("decoder.layers.0.mystery.weight", "qwen3", global_layer={0: 0},
                         expert_offset=0, tied=False)
    with pytest.raises(ValueError, match="llama"):
        name_map.resolve("decoder.final_layernorm.weight", "llama", global_layer={}, expert_offset=0, tied=False)


def test_tables_are_one_to_one():
    for model_type, arch in archs().items():
        targets = [t if isinstance(t, tuple) else (t, None) for t in arch.names.values()]
        assert len(set(targets)) == len(targets), model_type


def test_expected_names_match_a_real_tiny_checkpoint(tmp_path):
    from dapo_megatron.assets.models import build_tiny_model
    from dapo_megatron.models import ModelSpec
    from dapo_megatron.weights import HFCheckpoint
    for kind, tied in (("qwen2", True), ("qwen3", False), ("qwen3_moe", False)):
        d = build_tiny_model(kind, str(tmp_path / kind), vocab_size=64, tie_word_embeddings=tied)
        ckpt = HFCheckpoint(d)
        expected = name_map.expected_hf_shapes(ModelSpec.from_pretrained(d))
        assert set(expected) == ckpt.keys(), kind
        assert all(ckpt.shape(name) == shape for name, shape in expected.items()), kind


def test_every_table_row_has_a_shape():
    for model_type, arch in archs().items():
        assert set(arch.names) <= set(name_map.hf_shapes(model_type))


def test_every_fused_or_sharded_row_has_a_tp_dim():
    for model_type in archs():
        for mcore, (kind, _) in name_map.mcore_to_hf_table(model_type).items():
            if kind != "copy" or "linear" in mcore or mcore in name_map.VOCAB_PARAMS:
                assert mcore in name_map.TP_DIM, mcore


@pytest.mark.parametrize("max_bytes,header_reserve", [(80, 1 << 20), (1 << 20, 200)],
                         ids=["files_split_by_bytes", "files_split_by_header_reserve"])
def test_shard_writer_streams_files_safetensors_reads(tmp_path, max_bytes, header_reserve):
    import json
    import os

    from safetensors import safe_open

    from dapo_megatron.weights import hf_io
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(6).reshape(2, 3),
               "d": torch.randn(4, 4, dtype=torch.float16).t(), "e": torch.zeros(0, 3), "f": torch.tensor([True, False])}
    # 80 bytes: "a" alone fills a file; a 200-byte header holds only two entries of these names
    writer = hf_io.ShardWriter(str(tmp_path), "part", max_bytes=max_bytes, header_reserve=header_reserve)
    for name, t in tensors.items():
        writer.add(name, t)
    writer.flush()
    hf_io.finalize_shards(str(tmp_path), writer.weight_map, writer.total_bytes)
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(files) >= 2 and sorted(os.listdir(tmp_path)) == sorted(files + [hf_io.INDEX])
    index = json.loads((tmp_path / hf_io.INDEX).read_text())
    assert set(index["weight_map"]) == set(tensors)
    for name, t in tensors.items():
        path = tmp_path / index["weight_map"][name]
        header_len = int.from_bytes(path.read_bytes()[:8], "little")
        assert header_len == header_reserve
        with safe_open(str(path), framework="pt") as f:
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(got, t), name
            assert f.metadata() == {"format": "pt"}


def test_shard_writer_syncs_in_background_and_reports_a_failed_sync(tmp_path, monkeypatch):
    import os

    from safetensors import safe_open

    from dapo_megatron.weights import hf_io
    synced = []
    monkeypatch.setattr(hf_io, "_SYNC_EVERY", 100)
    monkeypatch.setattr(os, "fdatasync", lambda fd: synced.append(fd))
    writer = hf_io.ShardWriter(str(tmp_path), "part", max_bytes=1 << 20)
    tensors = {f"t{i}": torch.randn(40) for i in range(6)}  # 160 bytes each: a sync per tensor
    for name, t in tensors.items():
        writer.add(name, t)
    writer.flush()
    assert synced, "no background fdatasync ran"
    with safe_open(str(tmp_path / writer.files[0]), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(n), t) for n, t in tensors.items())

    def failing(fd):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(os, "fdatasync", failing)
    writer = hf_io.ShardWriter(str(tmp_path), "again", max_bytes=1 << 20)
    with pytest.raises(OSError, match="Input/output error"):
        for name, t in tensors.items():
            writer.add(name, t)
        writer.flush()


def test_shard_writer_names_an_unsupported_dtype_or_an_oversized_entry(tmp_path):
    from dapo_megatron.weights import hf_io
    with pytest.raises(ValueError, match="tensor z: dtype torch.complex64"):
        hf_io.ShardWriter(str(tmp_path), "part", 1 << 20).add("z", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="tensor " + "x" * 100 + ": its header entry alone exceeds the 64-byte"):
        hf_io.ShardWriter(str(tmp_path), "part", 1 << 20, header_reserve=64).add("x" * 100, torch.zeros(2))
