"""Actor / reference log-probs and the DAPO update agree across TP / PP / VPP / EP layouts, with
HF transformers, and across micro-batch splits.

One `run_workers` job per layout runs every check of that layout (each job starts processes
and builds the models); the results are cached per module and the tests below only compare.
"""
import pytest
import torch

from dapo_megatron.train import microbatch as mb
from dapo_megatron.train.parallel import run_workers

import actor_jobs

pytestmark = [pytest.mark.distributed, pytest.mark.background]

LAYOUT_TOL = 1e-5  # fp32: Megatron layout vs TP1
HF_TOL = 1e-4  # fp32: Megatron vs HF transformers
MAX_TOKENS = 64  # several micro-batches per DP rank for the test batch
ON_POLICY = ("tp1", "ep2")  # layouts that check the update without an old-log-prob pass
# layout -> (parallel, world size, models for log-probs, train the MoE?)
LAYOUTS = {
    "tp1": (dict(), 1, ["moe", "qwen2_tied"], True),
    "tp2": (dict(tp=2, etp=2), 2, ["moe", "qwen2_tied"], True),
    "pp2": (dict(pp=2), 2, ["moe"], True),
    "pp2vpp2": (dict(pp=2, vpp=2), 2, ["qwen2_tied"], False),
    "ep2": (dict(ep=2), 2, ["moe"], True),
    "tp2xep2": (dict(tp=2, ep=2), 4, ["moe"], True),
}


@pytest.fixture(scope="module")
def batch():
    return actor_jobs.make_batch(n_samples=8)


def four_bin_budget(batch) -> int:
    """A token budget that splits the (single) mini-batch into exactly 4 micro-batches at TP1."""
    lengths = batch.sequence_lengths
    for budget in range(max(lengths), sum(lengths) * len(lengths)):
        if len(mb.token_bins(lengths, budget)) == 4:
            return budget
    raise AssertionError("no budget gives 4 micro-batches")


@pytest.fixture(scope="module")
def results(tiny_hf_models, batch):
    """Lazily run one spawn per layout; cached for the module."""
    cache = {}

    def get(layout):
        if layout not in cache:
            parallel, world, models, train = LAYOUTS[layout]
            updates = [dict(max_tokens_per_microbatch=MAX_TOKENS)] if train else []
            if layout == "ep2":  # the plan's state check without the distributed optimizer, other shapes
                updates.append(dict(max_tokens_per_microbatch=MAX_TOKENS, hf_dir=tiny_hf_models["a3b_like"],
                                    optim=dict(use_distributed_optimizer=False)))
            if layout == "tp1":  # 1 vs 4 micro-batches
                updates += [dict(max_tokens_per_microbatch=1 << 14),
                            dict(max_tokens_per_microbatch=four_bin_budget(batch))]
            if layout in ON_POLICY:  # two mini-batches in bypass mode, whole and streamed (lr warm-up on)
                updates += [dict(max_tokens_per_microbatch=MAX_TOKENS, old="rollout", ppo_mini_batch_size=2,
                                 optim=dict(lr_warmup_steps=4), stream=stream) for stream in (False, True)]
            if layout in ON_POLICY:  # the two-pass update, then the update as its own old policy; the
                # engine's log-probs as old ones, given, then taken by the update (actor.old_logprobs=rollout)
                updates += [dict(max_tokens_per_microbatch=MAX_TOKENS, old=old)
                            for old in ("exact", "update", "as_rollout", "rollout")]
            blobs = run_workers(actor_jobs.layout_job, world, [tiny_hf_models[m] for m in models], parallel,
                                batch, MAX_TOKENS, tiny_hf_models["moe"], updates, layout == "tp1", timeout_s=300)
            cache[layout] = [actor_jobs.unpack(b) for b in blobs]
        return cache[layout]
    return get


def hf_logprobs(hf_dir: str, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) [B, T] of the responses under HF transformers, one sample at a time."""
    from transformers import AutoModelForCausalLM
    from dapo_megatron.algo import entropy_from_logits
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    lp, ent = torch.zeros(batch.loss_mask.shape), torch.zeros(batch.loss_mask.shape)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(batch.prompts, batch.responses)):
            logits = model(torch.cat([p, r])[None]).logits[0, len(p) - 1: len(p) - 1 + len(r)]  # [R, V]
            lp[i, : len(r)] = torch.log_softmax(logits, -1).gather(-1, r[:, None])[:, 0]
            ent[i, : len(r)] = entropy_from_logits(logits)
    return lp, ent


@pytest.fixture(scope="module")
def hf_reference(tiny_hf_models, batch):
    return {name: hf_logprobs(tiny_hf_models[name], batch) for name in ("moe", "qwen2_tied")}


def _maxdiff(a, b, mask=None):
    d = (a - b).abs()
    return (d * mask if mask is not None else d).max().item()


def test_microbatch_plan_splits(batch):
    assert len(mb.token_bins(batch.sequence_lengths, MAX_TOKENS)) > 2


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logprobs_match_tp1_and_hf(layout, batch, hf_reference, results):
    _, _, models, _ = LAYOUTS[layout]
    per_rank, base = results(layout), results("tp1")[0]
    mask = batch.loss_mask
    for i, model in enumerate(models):
        ref_lp, ref_ent = hf_reference[model]
        tp1 = base["logprobs"][LAYOUTS["tp1"][2].index(model)]
        for rank, res in enumerate(per_rank):  # every rank returns the full result
            got = res["logprobs"][i]
            assert got["logprobs"].shape == mask.shape
            assert _maxdiff(got["logprobs"], ref_lp, mask) <= HF_TOL, f"{model} rank {rank}: logprobs vs HF"
            assert _maxdiff(got["entropy"], ref_ent, mask) <= HF_TOL, f"{model} rank {rank}: entropy vs HF"
            assert _maxdiff(got["ref"], ref_lp, mask) <= HF_TOL, f"{model} rank {rank}: reference vs HF"
            assert (got["logprobs"] * (1 - mask)).abs().sum() == 0  # padding positions are 0
            assert _maxdiff(got["logprobs"], tp1["logprobs"], mask) <= LAYOUT_TOL, f"{model} rank {rank} vs TP1"
            assert _maxdiff(got["entropy"], tp1["entropy"], mask) <= LAYOUT_TOL


def _assert_same_update(got: dict, want: dict, what: str):
    for key, value in want["metrics"][0].items():
        if key != "perf/actor_tokens_per_s":
            assert abs(got["metrics"][0][key] - value) <= LAYOUT_TOL, f"{what}: {key}"
    assert _maxdiff(got["logprobs"], want["logprobs"]) <= LAYOUT_TOL, f"{what}: log-probs after the update"
    actor_jobs.assert_same_weights(got, want, LAYOUT_TOL, what)


@pytest.mark.parametrize("layout", [k for k, v in LAYOUTS.items() if v[3] and k != "tp1"])
def test_update_matches_tp1(layout, results):
    want = results("tp1")[0]["updates"][0]
    per_rank = results(layout)
    names = set().union(*(r["updates"][0]["weights"] for r in per_rank))
    assert names == set(want["weights"]), "exported weights do not cover the model"
    for rank, res in enumerate(per_rank):
        _assert_same_update(res["updates"][0], want, f"{layout} rank {rank}")


@pytest.mark.parametrize("layout", [k for k, v in LAYOUTS.items() if v[3]])
def test_state_bytes_are_the_memory_plans(layout, results):
    """Parameters, main grads and optimizer state Megatron allocated on each rank (fp32) equal,
    byte for byte, what plan/state.py counts from the weight tables: padding, buckets and the
    distributed optimizer's shards included."""
    from dapo_megatron.models.spec import ModelSpec
    from dapo_megatron.plan.state import Layout, rank_state
    for res in results(layout):
        for upd in res["updates"]:
            c = upd["state"]["coords"]
            lay = Layout(world=c["world_size"], tp=c["tp"], pp=c["pp"], vpp=c["vpp"], ep=c["ep"], etp=c["etp"])
            want = rank_state(ModelSpec.from_pretrained(upd["hf_dir"]), lay, dtype="fp32",
                              distributed_optimizer=upd["distributed_optimizer"], stage=c["pp_rank"],
                              dp_rank=c["dp_rank"], edp_rank=c["edp_rank"])
            assert upd["state"]["bytes"] == vars(want), f"{layout} rank {c['rank']} {upd['hf_dir']}"


def test_update_one_vs_four_microbatches(results):
    base, one, four = results("tp1")[0]["updates"][:3]
    _assert_same_update(four, one, "4 vs 1 micro-batches")
    _assert_same_update(base, one, f"budget {MAX_TOKENS} vs 1 micro-batch")
    m = one["metrics"][0]
    assert m["actor/pg_clipfrac"] + m["actor/pg_clipfrac_lower"] > 0  # the clips are exercised
    assert m["actor/grad_norm"] > 0 and m["actor/kl_loss"] > 0


@pytest.mark.parametrize("layout", ON_POLICY)
def test_on_policy_update_is_the_two_pass_update(layout, results):
    """One mini-batch, one epoch: the update without old log-probs (its own forward, detached)
    moves the weights as the update after an old-log-prob pass does, to 1e-6, and measures the
    engine-vs-trainer gap that pass would have (rollout/*)."""
    for rank, res in enumerate(results(layout)):
        exact, shortcut = res["updates"][-4:-2]
        actor_jobs.assert_same_weights(shortcut, exact, 1e-6, f"{layout} rank {rank}")
        assert _maxdiff(shortcut["logprobs"], exact["logprobs"]) <= 1e-6
        for key, value in exact["metrics"][0].items():
            if key != "perf/actor_tokens_per_s":
                assert shortcut["metrics"][0][key] == pytest.approx(value, abs=1e-6), key
        gap = {k: shortcut["metrics"][0][k] for k in exact["gap"]}
        assert gap == pytest.approx(exact["gap"], abs=1e-6) and gap["rollout/logprob_diff_max"] > 1e-3
        assert "rollout/logprob_diff_max" not in exact["metrics"][0]  # the pass measures it there


@pytest.mark.parametrize("layout", ON_POLICY)
def test_bypass_mode_trains_against_the_engines_logprobs(layout, results):
    """actor.old_logprobs=rollout (verl's bypass mode): no old log-probs in the batch, the update
    takes the engine's as pi_old: the weights move as with the engine's log-probs given as the old
    ones, to 1e-6, and its forward measures the engine-vs-trainer gap (rollout/*)."""
    for rank, res in enumerate(results(layout)):
        given, bypass = res["updates"][-2:]
        actor_jobs.assert_same_weights(bypass, given, 1e-6, f"{layout} rank {rank}")
        moved = max(float((w - bypass["before"][k]).abs().max()) for k, w in bypass["weights"].items())
        assert moved > 1e-4  # the step moved them: the check means something
        for key, value in given["metrics"][0].items():
            if key != "perf/actor_tokens_per_s":
                assert bypass["metrics"][0][key] == pytest.approx(value, abs=1e-6), key
        gap = {k: bypass["metrics"][0][k] for k in bypass["gap"]}
        assert gap == pytest.approx(bypass["gap"], abs=1e-6) and gap["rollout/logprob_diff_max"] > 1e-3
        # pi_old is pi_rollout, not the update's own forward: the ratio departs from 1
        assert bypass["metrics"][0]["actor/ppo_kl"] != pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("layout", ON_POLICY)
def test_streamed_minibatches_update_as_the_whole_batch(layout, results):
    """trainer.stream_minibatches: a step's two mini-batches trained one call each, as they arrive,
    with the engine's log-probs as pi_old (bypass mode), move the weights as the whole batch's
    update does, and report its metrics; the warm-up schedule counts the step once."""
    for rank, res in enumerate(results(layout)):
        whole, streamed = res["updates"][-6:-4]
        actor_jobs.assert_same_weights(streamed, whole, 1e-6, f"{layout} rank {rank}")
        moved = max(float((w - whole["before"][k]).abs().max()) for k, w in whole["weights"].items())
        assert moved > 1e-5
        assert set(streamed["metrics"][0]) == set(whole["metrics"][0])
        for key, value in whole["metrics"][0].items():
            if key != "perf/actor_tokens_per_s":
                assert streamed["metrics"][0][key] == pytest.approx(value, abs=1e-6), key
        assert whole["metrics"][0]["actor/lr"] == pytest.approx(whole["lr"] / 4)  # warm-up step 1 of 4


def test_update_without_old_logprobs_is_refused_off_policy(results):
    """Two mini-batches (the second trains a policy one step on), two epochs, or
    actor.old_logprobs=recompute: no update without the pass's old log-probs."""
    errors = results("tp1")[0]["refusals"]
    assert len(errors) == 3 and all("needs batch.old_logprobs" in e for e in errors), errors
    assert "2 mini-batches x 1 epochs" in errors[0] and "1 mini-batches x 2 epochs" in errors[1]
    assert "actor.old_logprobs=recompute" in errors[2]
