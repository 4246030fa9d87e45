"""Checkpoints: exact resume in fresh processes, crash safety, weights-only resharding.

Three spawns share one checkpoint folder: EP2 training (2 steps, save, step 3, a save that raises
mid-write), an EP2 resume in fresh processes (step 3 again), and a TP1 load of the EP2 checkpoint
(a copy with one flipped bit refused, naming the file; optimizer state refused with a clear
message; weights resharded; a start from it, model.load_checkpoint, weights only), whose last act
is a save killed with os._exit after writing its shards.
"""
import os

import pytest
import torch
from test_convert import _convert

from dapo_megatron.train.parallel import WorkerError, run_workers

import actor_jobs

pytestmark = [pytest.mark.distributed, pytest.mark.background]

LAYOUT = dict(ep=2)


@pytest.fixture(scope="module")
def runs(tiny_hf_models, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    moe = tiny_hf_models["moe"]

    def spawn(world, parallel, phase):
        return [actor_jobs.unpack(b) for b in run_workers(actor_jobs.resume_job, world, moe, parallel, root, phase,
                                                          timeout_s=300)]
    out = {"root": root, "train": spawn(2, LAYOUT, "train")}
    out["listing_after_train"] = sorted(os.listdir(root))
    out["latest_after_train"] = open(os.path.join(root, "latest")).read()
    out["resume"] = spawn(2, LAYOUT, "resume")
    step2 = os.path.join(root, "step_2")
    out["step2_files"] = sorted((n, os.path.getsize(os.path.join(step2, n))) for n in os.listdir(step2))
    with pytest.raises(WorkerError, match="exit code 3"):
        spawn(1, dict(), "reshard")
    with open(os.path.join(root, "reshard_result.pt"), "rb") as f:
        out["reshard"] = actor_jobs.unpack(f.read())
    return out


def test_exception_during_save_keeps_previous_checkpoint(runs):
    assert runs["train"][0]["crash"] == "simulated crash during the save"
    assert runs["latest_after_train"] == "step_2"
    assert "step_3" not in runs["listing_after_train"]  # the half-written save was never published
    assert runs["resume"][0]["path"].endswith("step_2")  # ...and `auto` resumes from the previous one


def test_resume_matches_uninterrupted_run(runs):
    want, want_lp = runs["train"][0]["metrics"][2], runs["train"][0]["logprobs_after_3"]
    for res in runs["resume"]:
        assert res["trainer_state"] == {"step": 2, "sampler": [7, 8]}
        got = res["metrics"][0]
        for key in want:
            if key != "perf/actor_tokens_per_s":
                assert got[key] == want[key], key  # exactly: same weights, Adam state, LR step
        # After step 3 the weights depend on the restored Adam moments, step count and schedule.
        assert (res["logprobs_after_3"] - want_lp).abs().max().item() == 0


def test_weights_reshard_ep2_to_tp1_and_optimizer_refusal_is_clear(runs):
    res = runs["reshard"]
    assert "load_optimizer=False" in res["optimizer_error"] and "ep=2" in res["optimizer_error"]
    assert res["trainer_state"]["step"] == 2
    diff = (res["logprobs_after_2"] - runs["train"][0]["logprobs_after_2"]).abs().max().item()
    assert diff <= 1e-5


def test_a_start_from_a_checkpoint_has_its_weights_and_nothing_else(runs):
    """model.load_checkpoint: an actor built without model.path's weights (and a reference) started
    from the EP2 run's step_2, at TP1, give the trained actor's log-probs, not model.path's; the LR
    schedule and Adam state stay fresh (a start, not a resume)."""
    res, trained = runs["reshard"], runs["train"][0]["logprobs_after_2"]
    assert (res["hf_logprobs"] - trained).abs().max().item() > 1e-3  # two updates moved the weights
    for got in (res["start_logprobs"], res["start_ref_logprobs"]):
        assert (got - trained).abs().max().item() <= 1e-5
    assert res["start_lr_steps"] == 0 and res["start_adam_state"] == 0
    err = res["start_damaged_error"]
    assert err.startswith("model.load_checkpoint: ") and "is damaged" in err, err


def test_a_damaged_checkpoint_is_refused_naming_the_file(runs):
    assert "checksums.json" in dict(runs["step2_files"])
    err = runs["reshard"]["damaged_error"]
    assert "is damaged" in err and ".distcp" in err and "trainer.resume_mode" in err, err


def test_a_training_checkpoint_exports_to_hf(runs, tiny_hf_models, tmp_path):
    """mcore-to-hf on a step folder with no other flag (the checkpoint carries the model's config in
    hf/): the model's tensors are exported, the Adam state (keys `chained_<i>.optimizer.*`) is not
    mistaken for tensors the model has no place for. A step folder without hf/ (an older
    checkpoint) is one error naming --hf-config and the model the run's config.yaml names."""
    import shutil
    hf, out = tiny_hf_models["moe"], tmp_path / "hf"
    step2 = os.path.join(runs["root"], "step_2")
    assert sorted(os.listdir(os.path.join(step2, "hf"))) == ["config.json", "generation_config.json"]  # no tokenizer here
    old = tmp_path / "run" / "checkpoints" / "step_2"
    shutil.copytree(step2, old, ignore=shutil.ignore_patterns("hf"))
    (tmp_path / "run" / "config.yaml").write_text(f"model:\n  path: {hf}\n")
    proc = _convert("mcore-to-hf", "--ckpt", old, "--out", tmp_path / "never")
    assert proc.returncode == 2 and "--hf-config" in proc.stderr and f"model.path={hf}" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "never").exists()
    proc = _convert("mcore-to-hf", "--ckpt", step2, "--out", out, "--tp", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    from dapo_megatron.weights import HFCheckpoint
    before, after = HFCheckpoint(hf), HFCheckpoint(str(out))
    assert before.keys() == after.keys()
    assert all(before.read(k).shape == after.read(k).shape for k in before.keys())
    assert any(not torch.equal(before.read(k), after.read(k)) for k in before.keys())  # two steps trained
    from transformers import AutoConfig
    assert AutoConfig.from_pretrained(str(out)).model_type == "qwen3_moe"


def test_kill_during_save_leaves_latest_on_previous(runs):
    root = runs["root"]
    assert open(os.path.join(root, "latest")).read() == "step_2"
    assert not os.path.exists(os.path.join(root, "step_5"))
    step2 = os.path.join(root, "step_2")  # untouched by the killed save (prune runs after publish)
    assert sorted((n, os.path.getsize(os.path.join(step2, n))) for n in os.listdir(step2)) == runs["step2_files"]
