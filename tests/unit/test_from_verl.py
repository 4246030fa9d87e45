"""The migration helper on real verl DAPO launch scripts (tests/data/verl, verbatim from verl and
verl-recipe): every key accounted for, and the printed command (or YAML) loads as our config."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
import warnings
from pathlib import Path

import pytest

from dapo_megatron.config import load_config
from dapo_megatron.config.load import CONFIG_DIR
from dapo_megatron.config.verl_compat import resolve
from dapo_megatron.tools.from_verl import main, parse_script

SCRIPTS = sorted((Path(__file__).parents[1] / "data" / "verl").glob("*.sh"))
# A Hydra override as scripts write it, one per line: `[+]+a.b.c=value`.
_OVERRIDE_LINE = re.compile(r"^\s*\+{0,2}[a-z_]+(\.[A-Za-z0-9_]+)+=")


def _quiet_load(overrides, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config("dapo", overrides, **kw)


def _run(argv) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(argv)
    return rc, out.getvalue()


def test_the_scripts_are_there():
    assert len(SCRIPTS) >= 8, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_every_key_accounted_for_and_the_command_loads(script, monkeypatch):
    monkeypatch.setenv("RAY_DATA_HOME", "/data")
    text = script.read_text()
    written = [line for line in text.splitlines() if _OVERRIDE_LINE.match(line)]
    overrides, _ = parse_script(text)
    outcomes = resolve(overrides)
    # Every override the script writes is parsed (none lost to shell syntax) and has an outcome.
    assert len(overrides) == len(outcomes) >= len(written) > 20
    assert not [o for o in outcomes if "$" in o.value and "${oc.env:" not in o.value], "unexpanded shell text"
    assert not [o for o in outcomes if o.action == "refused"], [o for o in outcomes if o.action == "refused"]
    assert all(o.reason for o in outcomes if o.action in ("ignored", "accepted")), "a reason for each"
    rc, printed = _run([str(script)])
    assert rc == 0
    command = [line for line in printed.splitlines() if not line.startswith("#")]
    words = shlex.split(" ".join(line.rstrip("\\") for line in command))
    assert words[:5] == ["python", "-m", "dapo_megatron.main", "--config-name", "dapo"]
    migrated = _quiet_load(words[5:])
    # The verl overrides, given to us unchanged, are the same config (the README's promise).
    assert _quiet_load(overrides) == migrated
    verl = {o.key: o.value.strip("'\"") for o in outcomes}
    assert migrated.data.max_response_length == int(verl["data.max_response_length"])
    assert migrated.rollout.n == int(verl["actor_rollout_ref.rollout.n"])
    assert migrated.actor.clip_ratio_high == float(verl["actor_rollout_ref.actor.clip_ratio_high"])


def test_yaml_output_loads_as_a_config(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_DATA_HOME", "/data")
    script = next(s for s in SCRIPTS if "qwen3_moe_30b_megatron" in s.name)
    rc, printed = _run([str(script), "--yaml"])
    assert rc == 0
    configs = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, configs)
    (configs / "migrated.yaml").write_text(printed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config("migrated", [], config_dir=configs)
    assert (cfg.actor.parallel.tp, cfg.actor.parallel.pp, cfg.actor.parallel.ep) == (4, 2, 2)
    assert cfg.reward.overlong_buffer.enable and cfg.reward.overlong_buffer.len == 4096
    assert cfg.model.load_checkpoint.endswith("Qwen3-30B-A3B-dist_ckpt") and cfg.actor.offload.params
    assert cfg.actor.offload.grads and cfg.actor.offload.optimizer


SHELL = """
NAME=demo
A=${UNSET_A:-"${HOME_DIR}/models/${NAME}"}
LEN=$(( (1024 + 1024) * 2 ))
OPTS=(
    # a comment inside the array
    actor_rollout_ref.rollout.max_num_batched_tokens=$((LEN + 1))   # trailing comment
    trainer.experiment_name="${NAME}-x"
)
python3 -m recipe.dapo.main_dapo \\
    actor_rollout_ref.model.path="$A" \\
    data.max_prompt_length=${LEN} \\
    "${OPTS[@]}" \\
    trainer.default_local_dir=./ckpts/$(date +%Y) \\
"""


def test_shell_forms_launch_scripts_use():
    overrides, env = parse_script(SHELL, {"HOME_DIR": "/home/u"})
    assert env["A"] == "/home/u/models/demo" and env["LEN"] == "4096"
    assert overrides[:4] == ["actor_rollout_ref.model.path=/home/u/models/demo", "data.max_prompt_length=4096",
                             "actor_rollout_ref.rollout.max_num_batched_tokens=4097", "trainer.experiment_name=demo-x"]
    assert re.fullmatch(r"trainer\.default_local_dir=\./ckpts/20\d\d", overrides[4])
    # A variable the script never sets is read from the run's environment, as the shell would.
    overrides, _ = parse_script(SHELL)
    assert overrides[0] == "actor_rollout_ref.model.path=${oc.env:HOME_DIR}/models/demo"


def test_a_key_read_nowhere_here_is_explained(tmp_path):
    """verl's data.val_batch_size has no key here (validation runs each engine's shard whole): the
    report says it is ignored and why, and the command leaves it out."""
    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main_ppo data.val_batch_size=64 data.train_batch_size=4\n")
    rc, printed = _run([str(script)])
    line = next(line for line in printed.splitlines() if "data.val_batch_size" in line)
    assert rc == 0 and line.startswith("# ignored") and "deprecated in verl" in line, printed
    assert "data.val_batch_size" not in "".join(line for line in printed.splitlines() if not line.startswith("#"))


def test_refused_key_exits_1_and_names_it(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main_ppo algorithm.adv_estimator=gae data.train_batch_size=4\n")
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert main([str(script)]) == 1
    assert "refused: algorithm.adv_estimator=gae" in err.getvalue() and "grpo" in err.getvalue()


def test_no_verl_command_exits_2(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("echo hello\n")
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert main([str(script)]) == 2
    assert err.getvalue().startswith("error: ") and len(err.getvalue().splitlines()) == 1


def test_fully_async_30b_script_lands_on_our_keys_and_plans(monkeypatch):
    """verl's fully asynchronous 30B-A3B recipe (16 x 32 prompts a push, staleness 0.6, 2 + 2 nodes of
    8): a step here is its push period; the memory plan gives its verdict on the layout as written
    (FSDP's sharding and Ulysses are verl's: the actor here is Megatron at TP1 EP1 unless told)."""
    from dapo_megatron.plan.__main__ import main as plan
    monkeypatch.setenv("RAY_DATA_HOME", "/data")
    script = next(s for s in SCRIPTS if s.name.startswith("fully_async_"))
    overrides, _ = parse_script(script.read_text())
    cfg = _quiet_load(overrides)
    t = cfg.trainer
    assert (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size, cfg.rollout.n) == (512, 32, 16)
    assert (t.mode, t.placement, t.max_staleness, t.stale_share, t.partial_rollout) == ("async", "split", 1, 0.6, True)
    assert t.parts(cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size) == 16  # each mini-batch as it is in
    assert (t.nnodes, t.n_gpus_per_node, cfg.rollout.num_devices) == (4, 8, 16)
    assert (t.total_training_steps, t.total_epochs, t.test_freq) == (400, 10, 25)
    assert cfg.actor.old_logprobs == "rollout" and cfg.actor.rollout_correction.is_level is None  # bypass mode
    assert cfg.algorithm.filter_groups.mode == "early_stop" and cfg.rollout.sync.bucket_mb > 0
    ours = [x for o in resolve(overrides) for x in o.ours if not x.startswith(("model.", "data.train_files", "data.val_files"))]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = plan(["--config-name", "dapo", "--hf-config", str(CONFIG_DIR / "hf" / "Qwen3-30B-A3B-Base.json"),
                   "--device-memory-gb", "80", *ours])
    assert rc in (0, 1) and "on 16 devices" in out.getvalue() and "engine devices (16)" in out.getvalue(), out.getvalue()
