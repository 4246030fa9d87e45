"""Driver metrics: jsonl rows, the console line, TensorBoard events and the PNG of curves."""
import json
import os

import pytest

from dapo_megatron.driver.metrics import MetricsLogger, write_event


def test_jsonl_console_tensorboard_and_png(tmp_path, capsys):
    log = MetricsLogger(str(tmp_path), ["console", "jsonl", "tensorboard"])
    log.log(0, {})  # step 0 without a validation set: a jsonl row, no empty console line
    for step in range(1, 4):
        sampled = {"val/pass@1": 0.25, "val/pass@2": 0.4, "val/maj@2": 0.3, "val/maj@1": 0.25}
        log.log(step, {"reward/mean": 0.1 * step, "acc/mean": 0.5, "timing/step": 1.5, "text": "skip me",
                       "bad": float("nan"), **({"val/acc": 0.25, **sampled} if step == 3 else {})})
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[3]["reward/mean"] == pytest.approx(0.3) and "text" not in rows[1] and "bad" not in rows[1]
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 3 and out[0].startswith("step 1:") and "reward/mean=0.1" in out[0]
    assert "val/acc=0.25" in out[2] and "val/acc" not in out[0]  # a validating step shows it
    assert "val/acc=0.25 val/pass@2=0.4 val/maj@2=0.3 " in out[2] and "@1" not in out[2]  # n > 1: pass@n, maj@n
    png = log.plot()
    log.close()
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 10_000
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tensorboard"))


def test_wandb_missing_is_a_warning(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.warns(UserWarning, match="wandb"):
        MetricsLogger(str(tmp_path), ["wandb"]).close()


def test_curves_mark_the_runs_events(tmp_path, monkeypatch):
    """A restart (events.jsonl) is a dashed line on every panel of curves.png, during the step
    after the last one logged before it (the figures are read as they are saved; was: the two
    PNGs' bytes differ)."""
    from matplotlib.figure import Figure
    saved, savefig = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (saved.append(fig), savefig(fig, *a, **kw))[1])

    def dashed(fig) -> list:
        return [[(list(line.get_xdata()), line.get_label()) for line in ax.get_lines() if line.get_linestyle() == "--"]
                for ax in fig.axes]
    log = MetricsLogger(str(tmp_path), ["jsonl"])
    for step in range(1, 5):
        log.log(step, {"reward/mean": 0.1 * step, "acc/mean": 0.5})
    log.plot()
    write_event(str(tmp_path), "restart", what="the actor died", step=2, checkpoint=None, restart=1)
    path = log.plot()
    log.close()
    assert json.loads(open(tmp_path / "events.jsonl").read())["step"] == 2
    plain, marked = saved
    assert len(marked.axes) > 1 and dashed(plain) == [[]] * len(plain.axes)
    assert dashed(marked) == [[([2.5, 2.5], "restart")]] * len(marked.axes)
    assert open(path, "rb").read()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_save_does_not_wait_for_the_curves(tmp_path, monkeypatch):
    """plot_soon returns while the figure is drawn in its own thread; close() waits for it, and the
    end's plot() for the one in flight (one figure at a time); a failed drawing is a warning."""
    import threading
    log = MetricsLogger(str(tmp_path), ["jsonl"])
    log.log(1, {"reward/mean": 0.1})
    release, draw = threading.Event(), log._draw
    monkeypatch.setattr(log, "_draw", lambda path: release.wait(30) and draw(path))
    future = log.plot_soon()
    assert not future.done() and not (tmp_path / "curves.png").exists()
    release.set()
    assert future.result(timeout=60) == str(tmp_path / "curves.png") and (tmp_path / "curves.png").exists()
    monkeypatch.setattr(log, "_draw", lambda path: 1 / 0)
    log.log(2, {"reward/mean": 0.2})  # something new to draw
    with pytest.warns(UserWarning, match="curves.png not drawn: ZeroDivisionError"):
        log.plot_soon().exception(timeout=60)
        log.close()


def test_curves_are_drawn_again_only_when_their_inputs_changed(tmp_path, monkeypatch):
    """The end of a run plots what its last save has just drawn: not again. A new row, a new
    event, or a deleted PNG draws it again."""
    log = MetricsLogger(str(tmp_path), ["jsonl"])
    drawn, draw = [], log._draw
    monkeypatch.setattr(log, "_draw", lambda path: drawn.append(path) or draw(path))
    log.log(1, {"reward/mean": 0.1})
    log.plot_soon().result(timeout=60)
    log.plot()
    assert len(drawn) == 1
    log.log(2, {"reward/mean": 0.2})
    log.plot()
    write_event(str(tmp_path), "restart", step=2)
    log.plot()
    (tmp_path / "curves.png").unlink()
    log.plot()
    log.plot(str(tmp_path / "other.png"))
    log.close()
    assert drawn == [str(tmp_path / "curves.png")] * 4 + [str(tmp_path / "other.png")]


def test_a_resumed_run_keeps_one_row_per_step(tmp_path):
    """Resumed from step 2's checkpoint after steps 3 and 4 were logged (a crash, save_freq 2):
    their rows move to metrics.discarded.jsonl (kept, not lost) and the steps logged again are the
    only rows of 3 and 4 in metrics.jsonl; TensorBoard's writer starts again past step 2."""
    log = MetricsLogger(str(tmp_path), ["jsonl", "tensorboard"])
    for step in range(0, 5):
        log.log(step, {"reward/mean": 0.1 * step})
    assert log.rewind(4) == 0 and len(log.history()) == 5  # nothing later than the checkpoint
    assert log.rewind(2) == 2
    for step in (3, 4):
        log.log(step, {"reward/mean": 1.0 + step})
    log.close()
    assert [(r["step"], r["reward/mean"]) for r in log.history()] == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 4.0), (4, 5.0)]
    discarded = [json.loads(line) for line in open(tmp_path / "metrics.discarded.jsonl")]
    assert [(r["step"], r["reward/mean"]) for r in discarded] == [(3, 0.1 * 3), (4, 0.1 * 4)]
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 2)) for e in events.Scalars("reward/mean")] == [
        (0, 0.0), (1, 0.1), (2, 0.2), (3, 4.0), (4, 5.0)]
