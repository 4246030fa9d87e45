"""bench/common.py: the launcher's command line and environment, the metrics reader on a file a
run is still writing, the median the benches report."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import common  # noqa: E402  (bench/ is not a package)


def test_read_metrics_leaves_out_a_torn_last_line(tmp_path):
    rows = [{"step": 1, "timing/step": 2.0}, {"step": 2, "timing/step": 1.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "timing/st')
    assert common.read_metrics(str(tmp_path)) == rows  # the run dir
    assert common.read_metrics(str(path)) == rows  # the file
    assert common.read_metrics(str(tmp_path / "none")) == []
    path.write_text(json.dumps(rows[0]) + "\n{torn\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(json.JSONDecodeError):  # only the last line may be cut short
        common.read_metrics(str(path))


def test_median():
    assert common.median([3.0, 1.0, 2.0]) == 2.0
    assert common.median([4, 1, 2, 3]) == 2.5  # statistics.median: the mean of the middle two
    rows = [{"t": 100.0}, {"t": 50.0}, {"t": 1.0}, {}, {"t": 3.0}]  # two warm-up steps; {}: not run that step
    assert common.median(rows, "t", skip=2) == 1.0
    assert common.median(rows, "t") == 3.0


def test_run_main_command_line_and_environment(tmp_path, monkeypatch):
    seen = {}

    class Proc:
        returncode = 0

        def __init__(self, argv, **kwargs):
            seen.update(argv=argv, **kwargs)
            self.pid = 1

        def communicate(self, timeout=None):
            seen["timeout"] = timeout
            return None, ""
    monkeypatch.setattr(subprocess, "Popen", Proc)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    started = []
    run = common.run_main("quickstart", [*common.NO_EVAL, "trainer.total_training_steps=3"], out_dir=str(tmp_path),
                          tree="/tree", env={"RAY_ADDRESS": "local"}, timeout=60, on_start=started.append)
    assert seen["argv"] == [sys.executable, "-m", "dapo_megatron.main", "--config-name", "quickstart", *common.NO_EVAL,
                            "trainer.total_training_steps=3", f"trainer.default_local_dir={tmp_path}"]
    assert seen["cwd"] == "/tree" and seen["timeout"] == 60 and len(started) == 1
    assert seen["env"]["PYTHONPATH"] == os.pathsep.join(["/tree", "/elsewhere"]) and seen["env"]["RAY_ADDRESS"] == "local"
    assert seen["stderr"] == subprocess.PIPE  # kept for the error message
    assert run.out_dir == str(tmp_path) and run.wall_s >= 0 and run.metrics() == []

    common.run_main("quickstart", [], out_dir="/out")  # this checkout: no cwd, the environment as it is
    assert seen["cwd"] is None and seen["env"]["PYTHONPATH"] == "/elsewhere" and "RAY_ADDRESS" not in seen["env"]


def test_run_main_fails_with_the_end_of_its_output(tmp_path, monkeypatch):
    class Failed:
        returncode, pid = 1, 1

        def __init__(self, argv, stdout=None, **kwargs):
            if stdout not in (None, subprocess.DEVNULL):  # log=: the output goes to the file
                stdout.write("x" * 5000 + "Traceback: the real error\n")

        def communicate(self, timeout=None):
            return None, "boom: the real error"
    monkeypatch.setattr(subprocess, "Popen", Failed)
    with pytest.raises(SystemExit, match="exit 1.*\n.*boom: the real error"):
        common.run_main("quickstart", [], out_dir=str(tmp_path))
    with pytest.raises(SystemExit) as failed:
        common.run_main("quickstart", [], out_dir=str(tmp_path), log=str(tmp_path / "run.log"))
    assert str(failed.value).endswith("Traceback: the real error\n") and len(str(failed.value)) < 3100
