"""actor.offload / ref.offload: state to host memory and back changes nothing, bit for bit, and
really releases the device storages while offloaded (train/offload.py). Megatron's CPU optimizer
(actor.optim.cpu_offload): the same update, and a checkpoint round trip that resumes it exactly.

One spawn at TP1 x PP2 x EP2 (4 ranks, bf16, distributed optimizer: the fp32 master shards and
Adam's moments are the optimizer state that moves); every check below reads its result.
"""
import pytest
import torch

from dapo_megatron.train.parallel import run_workers

import actor_jobs

pytestmark = [pytest.mark.distributed, pytest.mark.background]

LAYOUT = dict(pp=2, ep=2)


@pytest.fixture(scope="module")
def ranks(tiny_hf_models, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cpu_optimizer"))
    return [actor_jobs.unpack(b) for b in run_workers(actor_jobs.offload_job, 4, tiny_hf_models["moe"], LAYOUT,
                                                      "bf16", root, timeout_s=300)]


def test_offloaded_storages_are_released(ranks):
    for rank, res in enumerate(ranks):
        for group, sizes in res["held"].items():
            assert sizes and all(n == 0 for n in sizes), f"rank {rank} {group}: {sizes}"
        # ...and every tensor of the training state was among them (was: only the storages the
        # offloader listed were checked, so a tensor its tables missed went unseen)
        assert res["state_tensors"] > 0 and res["unreleased"] == [], f"rank {rank}: {res['unreleased']}"
        assert "offloaded" in res["offloaded_error"] and "onload" in res["offloaded_error"]
        assert res["ref_held"] and all(n == 0 for n in res["ref_held"])  # ref.offload: built, then offloaded
        assert res["ref_held_after"] and all(n == 0 for n in res["ref_held_after"])  # ...and after each use


def test_update_after_offload_and_onload_is_bit_identical(ranks):
    for rank, res in enumerate(ranks):
        (kept_w, moved_w), (kept_o, moved_o) = res["weights"], res["optimizer"]
        assert kept_w.keys() == moved_w.keys() and kept_w
        for name in kept_w:
            assert torch.equal(kept_w[name], moved_w[name]), f"rank {rank}: {name}"
        assert len(kept_o) == len(moved_o) and len(kept_o) > 0
        assert any(t.dtype == torch.float32 and t.numel() > 1 for t in kept_o)  # master shards / moments
        for i, (a, b) in enumerate(zip(kept_o, moved_o)):
            assert torch.equal(a, b), f"rank {rank}: optimizer tensor {i}"
        kept_m, moved_m = (m[1] for m in res["metrics"])
        for key in kept_m:
            if key != "perf/actor_tokens_per_s":
                assert kept_m[key] == moved_m[key], key
        # the step moved the weights: a no-op update would pass the equality too
        assert res["metrics"][0][1]["actor/grad_norm"] > 0


def test_bf16_state_bytes_are_the_memory_plans(ranks, tiny_hf_models):
    """bf16 at TP1 x PP2 x EP2 with the distributed optimizer: the fp32 master shards join Adam's
    moments; dense state is sharded over DP 2, experts over expert-DP 1 (plan/state.py)."""
    from dapo_megatron.models.spec import ModelSpec
    from dapo_megatron.plan.state import Layout, rank_state
    spec = ModelSpec.from_pretrained(tiny_hf_models["moe"])
    for res in ranks:
        c = res["state"]["coords"]
        want = rank_state(spec, Layout(world=4, **LAYOUT), dtype="bf16", distributed_optimizer=True,
                          stage=c["pp_rank"], dp_rank=c["dp_rank"], edp_rank=c["edp_rank"])
        assert res["state"]["bytes"] == vars(want), f"rank {c['rank']}"


def test_reference_offload_gives_the_same_logprobs(ranks):
    for res in ranks:
        resident, offloaded = res["ref_logprobs"]
        assert torch.equal(resident, offloaded)


def test_cpu_optimizer_takes_the_same_step_and_resumes_exactly(ranks):
    """On a CPU rank the host is the device: the hybrid optimizer steps the whole shard in its
    host optimizers (the fraction and the drop in device memory are the GPU script's check).
    Its update equals the distributed optimizer's, bit for bit; the distributed optimizer keeps no
    fp32 master of its own; a save after step 1 loads the moments and gives the same step 2."""
    for rank, res in enumerate(ranks):
        cpu = res["cpu_optimizer"]
        assert all(name == "HybridDeviceOptimizer" and n > 0 and host_only for name, n, host_only in cpu["inner"])
        assert cpu["device_masters"] and all(m is None for m in cpu["device_masters"])  # masters: the hybrid's
        want = res["metrics"][0][0]  # the device optimizer's step 1
        assert all(cpu["metrics"][0][k] == want[k] for k in want if k != "perf/actor_tokens_per_s")
        saved, loaded = cpu["moments"]
        assert len(saved) == len(loaded) and any(t.abs().sum() > 0 for t in saved)
        for a, b in zip(saved, loaded):
            assert torch.equal(a, b), f"rank {rank}: moments after the load"
        (after_saved, after_loaded), kept = cpu["weights"], res["weights"][0]
        for name in after_saved:
            assert torch.equal(after_saved[name], after_loaded[name]), f"rank {rank}: {name}"
            assert torch.equal(after_saved[name], kept[name]), f"rank {rank}: {name} differs from the device optimizer's"
