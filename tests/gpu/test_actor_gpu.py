"""The Megatron actor on one real GPU (fp32, in-process, world size 1): response log-probs match
HF transformers on the same weights, and one DAPO update is finite and moves the weights."""
import math
import os
import sys

import pytest
import torch

from dapo_megatron.device import detect

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "distributed"))
import actor_jobs  # noqa: E402  (batch and config builders shared with the distributed tests)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(detect() == "cpu", reason="needs an accelerator")]

HF_TOL = 1e-4  # fp32: Megatron vs HF transformers, as in tests/distributed/test_actor.py
VOCAB = 500


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from dapo_megatron.assets.models import build_tiny_model
    from dapo_megatron.config.schema import ParallelConfig
    from dapo_megatron.parallel import free_port
    from dapo_megatron.train.actor import Actor
    from dapo_megatron.train.parallel import destroy_parallel, init_parallel
    hf_dir = build_tiny_model("qwen3_moe", str(tmp_path_factory.mktemp("gpu") / "moe"), vocab_size=VOCAB, seed=0)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    init_parallel(ParallelConfig())
    actor = Actor(actor_jobs.actor_config({}, max_tokens_per_microbatch=64), hf_dir, n=2)
    yield hf_dir, actor
    destroy_parallel()


def hf_logprobs_on_gpu(hf_dir: str, batch) -> torch.Tensor:
    """[B, T] response log-probs under HF transformers on the GPU, one sample at a time."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").cuda().eval()
    out = torch.zeros(batch.loss_mask.shape)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(batch.prompts, batch.responses)):
            logits = model(torch.cat([p, r])[None].cuda()).logits[0, len(p) - 1: len(p) - 1 + len(r)]  # [R, V]
            out[i, : len(r)] = torch.log_softmax(logits, -1).gather(-1, r[:, None].cuda())[:, 0].cpu()
    return out


def test_actor_logprobs_match_hf_and_update_on_gpu(setup):
    hf_dir, actor = setup
    assert next(actor.model[0].parameters()).is_cuda
    batch = actor_jobs.make_batch(n_samples=8, vocab=VOCAB)
    mask = batch.loss_mask
    got = actor_jobs.everywhere(actor.compute_logprobs(batch, with_entropy=True))
    assert got["logprobs"].shape == mask.shape and torch.isfinite(got["entropy"]).all()
    diff = ((got["logprobs"] - hf_logprobs_on_gpu(hf_dir, batch)).abs() * mask).max().item()
    print(f"max |actor - HF| log-prob difference on {torch.cuda.get_device_name()}: {diff:.3e}")
    assert diff <= HF_TOL
    assert (got["logprobs"] * (1 - mask)).abs().sum() == 0  # padding positions are 0

    before = [p.detach().clone() for p in actor.model[0].parameters()]
    batch.old_logprobs = actor_jobs.perturbed_old(got["logprobs"])
    batch.ref_logprobs = batch.old_logprobs - 0.05
    metrics = actor.update(batch)
    print({k: round(v, 6) for k, v in metrics.items()})
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["actor/grad_norm"] > 0
    moved = max((p.detach() - b).abs().max().item() for p, b in zip(actor.model[0].parameters(), before))
    assert 0 < moved < 1e-2  # Adam's first step moves a weight by ~lr = 1e-4
    after = actor_jobs.everywhere(actor.compute_logprobs(batch))["logprobs"]
    assert ((after - got["logprobs"]).abs() * mask).max() > 0


def test_cpu_optimizer_takes_the_same_step_and_frees_the_optimizer_on_the_device(setup):
    """Megatron's CPU optimizer (actor.optim.cpu_offload) on a real GPU, bf16, world size 1: the
    step equals the device optimizer's (its host AdamW against the device Adam, within a bf16
    rounding), and the device holds the plan's optimizer term less: all of it at fraction 1,
    about half at 0.5 (Megatron offloads whole parameters)."""
    from dapo_megatron.models.spec import ModelSpec
    from dapo_megatron.plan.state import Layout, rank_state
    from dapo_megatron.train.actor import Actor
    hf_dir, _ = setup
    planned = rank_state(ModelSpec.from_pretrained(hf_dir), Layout(world=1), dtype="bf16",
                         distributed_optimizer=True, stage=0, dp_rank=0, edp_rank=0).optimizer
    batch = actor_jobs.make_batch(n_samples=8, vocab=VOCAB, seed=5)
    held, weights = {}, {}
    for name, optim in (("device", {}), ("host", dict(cpu_offload=True)),
                        ("half", dict(cpu_offload=True, cpu_offload_fraction=0.5))):
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        actor = Actor(actor_jobs.actor_config({}, optim=dict(use_distributed_optimizer=True, **optim),
                                              max_tokens_per_microbatch=64), hf_dir, n=2, dtype="bf16")
        batch.old_logprobs = actor_jobs.perturbed_old(actor_jobs.everywhere(actor.compute_logprobs(batch))["logprobs"])
        batch.ref_logprobs = batch.old_logprobs - 0.05
        actor.update(batch)
        torch.cuda.synchronize()
        held[name] = torch.cuda.memory_allocated() - start
        weights[name] = [p.detach().float().cpu() for p in actor.model[0].parameters()]
        del actor
    print({k: f"{v / 2**20:.1f} MiB" for k, v in held.items()}, f"plan's optimizer term {planned / 2**20:.1f} MiB")
    for a, b in zip(weights["device"], weights["host"]):
        assert torch.allclose(a, b, rtol=2 ** -7, atol=1e-6)  # one bf16 rounding apart at most
    assert held["device"] - held["host"] == pytest.approx(planned, rel=0.05)
    assert held["device"] - held["half"] == pytest.approx(planned / 2, rel=0.25)


def test_cpu_optimizer_checkpoint_round_trip_on_gpu(setup, tmp_path):
    """A save of the CPU optimizer's actor after one step, loaded into a fresh one: the next step
    of both agrees (on a GPU, Megatron's load takes its TE / apex path for the hybrid optimizer,
    which the CPU round trip in tests/distributed does not)."""
    from dapo_megatron.train import checkpoint as ckpt
    from dapo_megatron.train.actor import Actor
    hf_dir, _ = setup

    def make():
        return Actor(actor_jobs.actor_config({}, optim=dict(use_distributed_optimizer=True, cpu_offload=True),
                                             max_tokens_per_microbatch=64), hf_dir, n=2, dtype="bf16")

    def step(actor, seed):
        batch = actor_jobs.make_batch(n_samples=8, vocab=VOCAB, seed=seed)
        batch.old_logprobs = actor_jobs.perturbed_old(actor_jobs.everywhere(actor.compute_logprobs(batch))["logprobs"])
        batch.ref_logprobs = batch.old_logprobs - 0.05
        return actor.update(batch)
    saved = make()
    step(saved, 1)
    path = ckpt.save_checkpoint(saved, str(tmp_path), 1, {"step": 1}, keep=1)
    loaded = make()
    ckpt.load_checkpoint(loaded, path)
    assert step(saved, 2)["actor/grad_norm"] == pytest.approx(step(loaded, 2)["actor/grad_norm"], rel=1e-3)
    for a, b in zip(saved.model[0].parameters(), loaded.model[0].parameters()):
        assert torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=1e-6)
