"""`python -m dapo_megatron.tools.same_run` on runs' metrics files (the checkpoint half runs on real
checkpoints in tests/e2e/test_driver.py and test_async.py)."""
from __future__ import annotations

import json

from dapo_megatron.tools import same_run


def _run(tmp_path, name: str, rows: list[dict]):
    out = tmp_path / name
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


ROWS = [{"step": 1, "reward/mean": 0.25, "actor/grad_norm": 1.5, "timing/step": 3.0, "memory/rss_gb": 2.0,
         "driver/cpu_s": 0.4, "data_plane/resident_mb": 1.0},
        {"step": 2, "reward/mean": 0.5, "actor/grad_norm": 1.25, "timing/step": 2.0}]


def test_the_clocks_aside_two_equal_runs_are_the_same(tmp_path, capsys):
    clocks = [dict(r, **{"timing/step": 9.0}) for r in ROWS]
    clocks[0].update({"memory/rss_gb": 5.0, "driver/cpu_s": 1.0, "data_plane/resident_mb": 0.0})
    assert same_run.main([str(_run(tmp_path, "a", ROWS)), str(_run(tmp_path, "b", clocks))]) == 0
    assert capsys.readouterr().out.startswith("the same run: 2 steps of metrics")


def test_the_first_differing_step_is_named_with_its_keys_and_values(tmp_path, capsys):
    other = [dict(ROWS[0]), dict(ROWS[1], **{"actor/grad_norm": 1.5, "reward/mean": 0.75})]
    assert same_run.main([str(_run(tmp_path, "a", ROWS)), str(_run(tmp_path, "b", other))]) == 1
    assert capsys.readouterr().out.strip() == \
        "step 2: 2 metrics differ: actor/grad_norm 1.25 / 1.5, reward/mean 0.5 / 0.75"
    assert same_run.main([str(_run(tmp_path, "c", ROWS)), str(_run(tmp_path, "d", ROWS[:1]))]) == 1
    assert "logged 2 and 1 steps" in capsys.readouterr().out


def test_a_missing_run_file_is_one_line_naming_it(tmp_path, capsys):
    run = _run(tmp_path, "a", ROWS)
    assert same_run.main([str(run), str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == \
        f"error: {tmp_path / 'nope' / 'metrics.jsonl'}: no such file (a run directory holds metrics.jsonl: " \
        "trainer.logger=[jsonl])"
    assert same_run.main([str(run), str(run), "--steps", "step_3"]) == 2
    assert capsys.readouterr().err.strip() == f"error: --steps: {run / 'checkpoints' / 'step_3'} does not exist"


def test_a_torn_metrics_line_is_one_line_naming_the_file_and_line(tmp_path, capsys):
    run = _run(tmp_path, "a", ROWS)
    torn = _run(tmp_path, "b", ROWS)
    (torn / "metrics.jsonl").write_text((torn / "metrics.jsonl").read_text() + '{"step": 3, "rew')
    assert same_run.main([str(run), str(torn)]) == 2
    assert capsys.readouterr().err.strip() == \
        f"error: {torn / 'metrics.jsonl'}: line 3 is not a JSON row: '{{\"step\": 3, \"rew'"
