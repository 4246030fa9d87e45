"""The overlapping modes end to end on `quickstart_async`'s layout (split placement, one training
rank and one engine) and the tiny task.

one_step_off: three steps in this process, a checkpoint after each, each batch handed over in two
mini-batches (trainer.stream_minibatches). The engines generate step k + 1's batch with the
weights of step k - 1 while step k trains; a checkpoint saved while that
batch waits untrained gives its prompts back to the stream. Its training rank is killed -9 in
step 2's update: the run restarts from step 1's checkpoint with a new rank beside the engine,
rollout manager and data plane it kept, step 3's batch (asked ahead) dropped. It starts from
model.load_checkpoint: a Megatron checkpoint whose weights are not model.path's.
async (the config as shipped: two batches ahead, partial rollouts, early-stop sampling; verl's
DPPO-TV loss): killed -9 in step 3's update (the engine generating the next batches meanwhile),
then resumed to step 4.
deterministic_pair: async with partial rollouts under trainer.deterministic (one batch ahead, its
responses held at 3 tokens for each push), 4 steps, a checkpoint every second, run twice: never
killed, and its training rank killed -9 in step 3's update, in step 4's weight push and in step
4's save; both write the same.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests import cli
from tests.doc_runs import doc_args

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HERE = os.path.dirname(__file__)
BATCH = 4  # prompts a step, every one kept (dynamic sampling off): the stream moves by 4 a step


def _overrides(tiny_assets, out, steps: int, **extra) -> list[str]:
    """The tiny task on quickstart_async's layout, `steps` steps, a checkpoint after each. Every
    path is the test's own (the config's tiny:// val_files built the demo's bundle, ~1 min, in
    ~/.cache on a fresh machine)."""
    overrides = {
        "model.path": str(tiny_assets / "qwen3_moe"), "data.train_files": f"[{tiny_assets / 'data' / 'train.parquet'}]",
        "data.val_files": f"[{tiny_assets / 'data' / 'val.parquet'}]",
        "data.train_batch_size": BATCH, "rollout.n": 4, "actor.ppo_mini_batch_size": BATCH,
        "data.max_response_length": 12, "trainer.total_training_steps": steps, "trainer.save_freq": 1,
        "trainer.val_before_train": "false", "trainer.default_local_dir": str(out), "trainer.logger": "[jsonl]",
        "reward.custom_fn": f"{HERE}/parity_reward.py:compute_score", **extra}
    return [f"{k}={v}" for k, v in overrides.items()]


def _uniform_checkpoint(tiny_assets, tmp) -> str:
    """model.path's weights with the final norm zeroed, converted to a Megatron checkpoint: every
    logit is 0, so the policy it starts is uniform over the vocabulary (entropy log V) where
    model.path's is not."""
    import shutil

    from safetensors.torch import load_file, save_file
    hf = tmp / "uniform-hf"
    shutil.copytree(tiny_assets / "qwen3_moe", hf)
    tensors = load_file(hf / "model.safetensors")
    tensors["model.norm.weight"].zero_()
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    out = tmp / "uniform-mcore"
    proc = subprocess.run([sys.executable, "-m", "dapo_megatron.convert", "hf-to-mcore", "--hf-dir", str(hf),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(out)


@pytest.fixture(scope="module")
def one_step_off(tiny_assets, tmp_path_factory, local_ray):
    from dapo_megatron.config import load_config
    from dapo_megatron.driver.supervisor import run
    from tests import faults
    out = tmp_path_factory.mktemp("one_step_off") / "run"
    overrides = _overrides(tiny_assets, out, 3, **{
        "data.gen_batch_size": BATCH,
        "algorithm.filter_groups.enable": "false", "trainer.max_checkpoints_to_keep": 3, "trainer.test_freq": 2,
        "trainer.mode": "one_step_off", "trainer.max_staleness": 1, "algorithm.filter_groups.mode": "sync",
        "trainer.max_restarts": 1, "actor.ppo_mini_batch_size": BATCH // 2, "trainer.stream_minibatches": "true",
        "model.load_checkpoint": _uniform_checkpoint(tiny_assets, tmp_path_factory.mktemp("start"))})
    cfg = load_config("quickstart_async", overrides)
    faults.install("rank:update:2")  # the driver, this process, kills the rank in step 2's update
    try:
        assert run(cfg) == 0  # on the session's Ray (tests/conftest.py): its end gives back what it took
    finally:
        faults.uninstall()
    return out, [json.loads(line) for line in open(out / "metrics.jsonl")]


def _saved_position(out, step: int) -> int:
    """Prompts the step's checkpoint has taken from the stream (the rollout manager's state)."""
    common = torch.load(out / "checkpoints" / f"step_{step}" / "common.pt", weights_only=False)
    prompts = common["trainer"]["prompts"]
    return prompts["epoch"] * prompts["num_items"] + prompts["position"] - len(prompts["pushed_back"])


def test_next_batch_is_generated_one_push_behind_while_the_step_trains(one_step_off):
    out, rows = one_step_off
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the first batch came from the start weights; each later one was asked before the previous
    # step's push: one policy version behind the weights it trains; but step 2's: asked again
    # after the restart, from the checkpoint's weights synced into the kept engine
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 0.0, 1.0]
    assert all("timing/trainer_wait" in r and "timing/gen" not in r for r in rows)
    assert ["timing/sync_wait" in r for r in rows] == [True, True, False]  # nothing asked past the last step
    # the batch's behaviour policy is not the proximal one: the decoupled weights are computed, by
    # default (quickstart_async sets no actor.rollout_correction: is_level=auto is token here)
    assert all("actor/is_weight_mean" in r and 0.0 <= r["actor/is_clipfrac"] <= 1.0 for r in rows)
    assert "val/acc" in rows[1]
    # each batch handed over in two mini-batches (trainer.stream_minibatches), one update each
    phases = [json.loads(line) for line in open(out / "phases.jsonl")]
    last = [(p["phase"], p["what"]) for p in phases if p["step"] == 3 and p["phase"] in ("trainer_wait", "update")]
    assert last == [("trainer_wait", [0]), ("update", []), ("trainer_wait", [1]), ("update", [])], last
    assert all(r["timing/stream_overlap"] >= 0 for r in rows)


def test_a_run_started_from_a_checkpoint_trains_and_samples_its_weights(one_step_off, tiny_assets):
    """model.load_checkpoint: step 1's actor scored with the checkpoint's uniform policy (entropy
    log V, not model.path's), and so did the engine, which loaded model.path and was synced the
    checkpoint's weights before it generated (their log-probs agree)."""
    import math
    out, rows = one_step_off
    vocab = json.loads((tiny_assets / "qwen3_moe" / "config.json").read_text())["vocab_size"]
    assert rows[0]["actor/entropy"] == pytest.approx(math.log(vocab), abs=1e-3), rows[0]
    assert rows[0]["rollout/logprob_diff_max"] < 1e-3, rows[0]


def test_a_checkpoint_gives_the_untrained_batchs_prompts_back(one_step_off):
    """When step 1 and 2 were saved, the next step's batch had been taken from the stream already:
    the checkpoints hold the position after the batches they trained, so a resume trains those
    prompts once."""
    out, rows = one_step_off
    assert [_saved_position(out, s) for s in (1, 2, 3)] == [BATCH, 2 * BATCH, 3 * BATCH]
    assert rows[-1]["data_plane/resident_mb"] == 0


def test_a_dead_rank_restarts_alone_and_drops_the_batch_asked_ahead(one_step_off):
    """The kill in step 2's update: one restart from step 1's checkpoint that kept the other roles;
    the batch of step 3, generated beside the update, was dropped (its rows cleared: the data plane
    holds nothing once the last step released its own; mid-run it holds the batch asked ahead), and
    the stream went on from the checkpoint (the positions above)."""
    from dapo_megatron.driver.recovery import KEPT
    out, rows = one_step_off
    (event,) = [json.loads(line) for line in open(out / "events.jsonl")]
    assert (event["event"], event["step"], event["kept"]) == ("restart", 1, list(KEPT)), event
    assert event["checkpoint"] == str(out / "checkpoints" / "step_1")
    assert rows[-1]["data_plane/resident_mb"] == 0 < rows[0]["data_plane/resident_mb"]


# trainer.deterministic in async with partial rollouts and early-stop sampling (quickstart_async's:
# the waves of rollout/collection/stream.py, each response of the batch asked ahead held for the
# push at 3 tokens: rollout/features.py's Segments), a checkpoint every second step: the batch
# after a save is asked once it is saved (a save drains), so that a resume from it generates what
# the run did. (The drained modes, one_step_off and async without partial rollouts, are this
# with segments as long as the responses.)
DETERMINISTIC = {"trainer.deterministic": "true", "trainer.max_staleness": 1, "trainer.segment_tokens": 3,
                 "data.gen_batch_size": 6, "trainer.save_freq": 2, "trainer.test_freq": 0, "trainer.max_restarts": 3}


def _deterministic(tiny_assets, out, *kills: str) -> list[dict]:
    from dapo_megatron.config import load_config
    from dapo_megatron.driver.supervisor import run
    from tests import faults
    faults.install(*kills)
    try:
        assert run(load_config("quickstart_async", _overrides(tiny_assets, out, 4, **DETERMINISTIC))) == 0
    finally:
        faults.uninstall()
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


@pytest.fixture(scope="module")
def deterministic_pair(tiny_assets, tmp_path_factory, local_ray):
    """The run never killed, and the same run with its training rank killed -9 in step 3's update,
    again in step 4's weight push and again in step 4's save (the checkpoint half written): each
    time it restarts itself from step 2's checkpoint and generates step 3 again."""
    never = tmp_path_factory.mktemp("never") / "run"
    killed = tmp_path_factory.mktemp("killed") / "run"
    return ((never, _deterministic(tiny_assets, never)),
            (killed, _deterministic(tiny_assets, killed, "rank:update:3", "rank:sync:4", "rank:save:4")))


def test_partial_rollouts_killed_and_resumed_equal_the_run_never_killed(deterministic_pair):
    from dapo_megatron.tools import same_run
    (never, rows), (killed, rows_killed) = deterministic_pair
    events = [json.loads(line) for line in open(killed / "events.jsonl")]
    assert [(e["event"], e["step"], e["checkpoint"]) for e in events] == \
        [("restart", s, str(killed / "checkpoints" / "step_2")) for s in (2, 3, 4)], events  # (`step`: the last logged)
    # steps 2 and 4 were generated while the step before trained, their pushes landing 3 tokens
    # into the responses still running (partial); step 3 after step 2's save: nothing was asked
    # past it, so its sync waited for nothing
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 0.0, 1.0], rows
    assert [r["rollout/partial_frac"] > 0 for r in rows] == [False, True, False, True], rows
    assert ["timing/sync_wait" in r for r in rows] == [True, False, True, False], rows
    assert all(r["sampling/aborted_groups"] == 0 for r in rows)  # waves: nothing aborted
    assert len(rows_killed) == 4
    assert same_run.compare(never, killed, ["step_2", "step_4"]) == []  # metrics but the clocks, checkpoints


ASYNC_STEPS = 5


@pytest.fixture(scope="module")
def async_killed_then_resumed(tiny_assets, tmp_path_factory, local_ray):
    """Two processes as a user runs them: killed -9 in step 3's update, then the same command.
    The first also loses its engine (kill -9) in step 1's weight sync."""
    from tests import faults
    out = tmp_path_factory.mktemp("async") / "run"
    # actor.ppo_epochs=2: a slowed trainer, so the manager runs ahead to the bound; the second
    # epoch's ratios depart from 1 under verl's DPPO-TV loss (a row of algo/loss.py like any other)
    overrides = _overrides(tiny_assets, out, ASYNC_STEPS, **{"data.gen_batch_size": 6, "actor.ppo_epochs": 2,
                                                             "rollout.max_engine_restarts": 1,
                                                             "actor.policy_loss": "dppo_tv"})
    args = [*doc_args("python -m dapo_megatron.main --config-name quickstart_async"), *overrides]
    cmd = [sys.executable, "-m", "dapo_megatron.main", *args]
    env = {k: v for k, v in os.environ.items() if k != faults.FAULTS_ENV}
    env.update(cli.joining(local_ray))  # the session's Ray, as a driver joins its cluster
    killed = subprocess.run([sys.executable, faults.__file__, *args],  # the same run, with the faults installed
                            env={**env, faults.FAULTS_ENV: "driver:update:3,engine:sync:1"},
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    rows_killed = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    events = [json.loads(line) for line in open(out / "events.jsonl")]
    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return out, rows_killed, resumed.stdout, [json.loads(line) for line in open(out / "metrics.jsonl")], \
        killed.stdout, events


def test_async_trains_no_token_older_than_max_staleness(async_killed_then_resumed):
    """The driver checks every response's recorded versions (it stops on a lag past the bound);
    here the bound is reached: the tiny engine generates faster than the rank trains two epochs,
    so the manager runs max_staleness batches ahead. Each run's first batch is the start weights'."""
    rows = async_killed_then_resumed[3]
    lags = [r["rollout/staleness_max"] for r in rows]
    assert max(lags) == 2.0 and lags[0] == lags[2] == 0.0, lags  # trainer.max_staleness=2 in quickstart_async
    # Responses a push reached mid-generation (partial rollouts): none in a batch no push of its run
    # could reach (each run's first), and a split response's first token is older than the weights
    # it trains (lag >= 1). Here 12-token responses mostly finish before a push lands; the split
    # itself, at scripted push points, is tests/unit/test_async_versions.py's.
    partial = [r["rollout/partial_frac"] for r in rows]
    assert partial[0] == partial[2] == 0.0, partial
    assert all(p == 0.0 or lag >= 1 for p, lag in zip(partial, lags)), (partial, lags)
    assert all(0.0 <= r["timing/engine_idle_frac"] <= 1.0 for r in rows)
    assert all("timing/trainer_wait" in r and "timing/sync_wait" not in r for r in rows)  # pushes do not drain
    # DPPO-TV trained it: its share of tokens outside the trust region is its pg_clipfrac, and the
    # dual clip's is not its (a row reports 0 for what it does not have)
    assert all(0.0 <= r["actor/pg_clipfrac"] <= 1.0 and r["actor/pg_clipfrac_dual"] == 0.0 for r in rows)
    assert "policy_loss: dppo_tv" in (async_killed_then_resumed[0] / "config.yaml").read_text()


def test_async_killed_mid_update_resumes_with_every_prompt_trained_once(async_killed_then_resumed):
    out, rows_killed, stdout, rows = async_killed_then_resumed[:4]
    assert rows_killed == [1, 2] and [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert f"resumed from {out / 'checkpoints' / 'step_2'} at step 2" in stdout, stdout[-3000:]
    # Each step took from the stream exactly the prompts it scored, less those of the groups it
    # took over still running from the step before, plus those it left running for the next
    # (partial rollouts: never aborted), across the kill too: the batches generated ahead and
    # never trained, and the groups left running, gave theirs back.
    carried = [r["sampling/carried_groups"] for r in rows]
    assert any(carried), carried
    for before, row in zip(rows, rows[1:]):
        assert (row["data/prompts_consumed"] - before["data/prompts_consumed"]
                == row["sampling/generated_groups"] - before["sampling/carried_groups"] + row["sampling/carried_groups"])
    assert rows[0]["data/prompts_consumed"] == rows[0]["sampling/generated_groups"] + carried[0]
    assert [_saved_position(out, s) for s in (4, 5)] == [rows[3]["data/prompts_consumed"] - carried[3],
                                                         rows[4]["data/prompts_consumed"] - carried[4]]
    assert rows[-1]["data_plane/resident_mb"] == 0


def test_async_engine_dead_in_the_weight_sync_is_replaced_by_the_managers_report(async_killed_then_resumed):
    """The engine killed as step 1's weight sync begins, while the manager generates the next batches
    beside the sync (partial rollouts): the sync finishes without it, the manager's next call to it
    reports the death and generates its groups again (counted exactly: the test above), and the
    driver replaces it when it next waits for a batch, before step 3's update. Was: the sync
    stopped the run."""
    killed_stdout, events = async_killed_then_resumed[4:]
    (event,) = events  # the resumed run lost nothing
    assert event["event"] == "engine_restart" and event["restart"] == 1 and event["step"] in (1, 2), event
    assert re.search(r"step [23]: rollout engine 0 replaced in", killed_stdout), killed_stdout[-3000:]
