"""trainer.max_restarts: a dead role restarts the run from the newest checkpoint the dead attempt
saved or resumed from, with a console line and a line of events.jsonl; spent restarts stop with the
role's error naming the key; 0 (the default) raises today's error unchanged. The restart of real
roles (a training rank killed -9) is tests/e2e/test_driver.py's."""
import json

import pytest

from dapo_megatron import roles
from dapo_megatron.config import ConfigError, load_config
from dapo_megatron.driver import supervisor

WHAT = "the actor died: The actor died unexpectedly"
DIED = f"{WHAT}; restart the run, it resumes from the last checkpoint (trainer.resume_mode=auto)"


def _cfg(tmp_path, restarts):
    return load_config("quickstart", [f"trainer.max_restarts={restarts}", f"trainer.default_local_dir={tmp_path}"])


def _dies(calls: list, deaths: int, checkpoint=True, keeps=None):
    """A stand-in for one attempt of the run: records the resume_mode it got, dies `deaths` times,
    leaving `keeps` (what a real attempt's `keep_roles` gives) when it may."""
    def attempt(cfg, kept=None, may_keep=False):
        calls.append(cfg.trainer.resume_mode)
        if keeps is not None:
            calls.append((kept, may_keep))
        if len(calls) <= deaths * (1 if keeps is None else 2):
            died = roles.RoleDied(WHAT)
            died.checkpoint, died.step = (f"/run/checkpoints/step_{len(calls)}" if checkpoint else None), len(calls)
            died.kept = keeps if may_keep else None
            raise died
        return 0
    return attempt


def test_a_dead_role_restarts_the_run_from_its_newest_checkpoint(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(supervisor, "attempt", _dies(calls, 2))
    assert supervisor.run(_cfg(tmp_path, 2)) == 0
    assert calls == ["auto", "/run/checkpoints/step_1", "/run/checkpoints/step_2"]
    events = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert [(e["event"], e["step"], e["checkpoint"], e["restart"]) for e in events] == [
        ("restart", 1, "/run/checkpoints/step_1", 1), ("restart", 2, "/run/checkpoints/step_2", 2)]
    assert events[0]["what"] == WHAT and events[0]["time"] > 0
    out = capsys.readouterr().out
    assert ("the actor died: The actor died unexpectedly: restart 1 of trainer.max_restarts=2, from "
            "/run/checkpoints/step_1") in out


def test_roles_an_attempt_kept_go_to_the_next_attempt(tmp_path, monkeypatch, capsys):
    """A training rank's death may keep the other roles (recovery.keep_roles) while a restart is
    left: the next attempt gets them, the console and events.jsonl say so; the last attempt may
    keep nothing (its Ray goes when it dies: no restart would take the roles over)."""
    calls, kept = [], object()
    monkeypatch.setattr(supervisor, "attempt", _dies(calls, 1, keeps=kept))
    assert supervisor.run(_cfg(tmp_path, 1)) == 0
    assert calls[1::2] == [(None, True), (kept, False)]
    (event,) = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert event["kept"] == ["the rollout engines", "the rollout manager", "the data plane"]
    assert "restart 1 of trainer.max_restarts=1, from /run/checkpoints/step_2; the rollout engines, the rollout " \
           "manager, the data plane kept" in capsys.readouterr().out


class _Died:
    """What keep_roles reads of a run and of Ray, each refusal flipping one of them."""

    def __init__(self, **run):
        from types import SimpleNamespace
        from dapo_megatron.config.schema import SyncConfig, TrainerConfig
        trainer = TrainerConfig(mode=run.pop("mode", "sync"), partial_rollout=True)
        rollout = SimpleNamespace(sync=SyncConfig(transport=run.pop("transport", "object_store")))
        self.run = SimpleNamespace(cfg=SimpleNamespace(trainer=trainer, rollout=rollout), ctx=None,  # ctx: never reached
                                   syncing=None, checkpoint="/ckpt/step_2")
        vars(self.run).update(run)
        self.died = roles.RoleDied("the training rank 1 died: gone")
        self.died.rank = "rank-1"


@pytest.mark.parametrize("why", ["no rank", "broadcast sync", "replacement's sync", "no checkpoint", "async partial",
                                 "node died"])
def test_keep_roles_refuses_what_a_kept_engine_could_not_survive(why, monkeypatch):
    """None (every role restarts) when the death is not a rank's own process, or came in a
    broadcast weight sync or a replacement engine's, before any checkpoint, or with async partial
    rollouts in flight; the ranks are not even killed then (the Ray shutdown takes them). The
    kept path itself runs on real roles: tests/e2e/test_driver.py's crash chain (a rank killed in
    an object-store sync) and test_async.py's one_step_off run (in an update)."""
    from dapo_megatron.driver import recovery
    case = _Died(**{"broadcast sync": {"syncing": "step", "transport": "broadcast"},
                    "replacement's sync": {"syncing": "replacement"}, "no checkpoint": {"checkpoint": None},
                    "async partial": {"mode": "async"}}.get(why, {}))
    if why == "no rank":
        case.died.rank = None
    reasons = []
    monkeypatch.setattr(recovery, "death_reason", lambda actor, wait_s: reasons.append(actor) or (
        "NODE_DIED" if why == "node died" else "WORKER_DIED"))
    assert recovery.keep_roles(case.run, case.died) is None
    assert reasons == (["rank-1"] if why == "node died" else [])


@pytest.mark.parametrize("syncing, transport, keeps", [
    (None, "broadcast", True), ("step", "object_store", True), ("resume", "object_store", True),
    ("step", "broadcast", False), ("resume", "broadcast", False), ("replacement", "object_store", False)])
def test_a_rank_dead_in_an_object_store_sync_may_leave_the_roles(syncing, transport, keeps):
    """sync_weights closes every engine's update however the push ended, so an object-store sync
    leaves them fit to keep; a broadcast receiver waits on the dead rank, a replacement's new
    engine is not the manager's yet."""
    from dapo_megatron.driver.recovery import _sync_keeps
    assert _sync_keeps(_Died(syncing=syncing, transport=transport).run) is keeps


def test_an_attempt_that_saved_nothing_restarts_as_the_run_started(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(supervisor, "attempt", _dies(calls, 1, checkpoint=False))
    assert supervisor.run(_cfg(tmp_path, 1)) == 0
    assert calls == ["auto", "auto"]


def test_spent_restarts_stop_naming_the_key(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(supervisor, "attempt", _dies(calls, 5))
    with pytest.raises(roles.RoleDied, match=r"^the actor died: .*\(trainer.max_restarts=1: every restart spent\)$"):
        supervisor.run(_cfg(tmp_path, 1))
    assert len(calls) == 2


def test_no_restarts_is_todays_error(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(supervisor, "attempt", _dies(calls, 1))
    with pytest.raises(roles.RoleDied) as err:
        supervisor.run(_cfg(tmp_path, 0))
    assert str(err.value) == DIED and calls == ["auto"] and not (tmp_path / "events.jsonl").exists()


def test_negative_restarts_are_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, -1)
    assert err.value.key == "trainer.max_restarts"


def test_the_command_says_what_died_in_one_line(tmp_path, monkeypatch, capsys):
    """`python -m dapo_megatron.main`: a dead role with no restart left is one error line (and
    where the roles' output is), exit code 1, not a traceback."""
    from dapo_megatron.main import EXIT_ROLE_DIED, main

    def dead(cfg):
        raise roles.RoleDied(WHAT, "trainer.max_restarts=1")
    monkeypatch.setattr(supervisor, "run", dead)
    assert main(["--config-name", "quickstart", f"trainer.default_local_dir={tmp_path}"]) == EXIT_ROLE_DIED == 1
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("error:")] == [f"error: {DIED} (trainer.max_restarts=1: every "
                                                                   f"restart spent)"]
    assert err[-1] == f"library output of the training ranks and engines: {tmp_path}/logs/"


# rollout.max_engine_restarts: the manager's record of dead engines (rollout/health.py); the
# replacement of a real engine killed -9 is tests/e2e/test_collect.py's and test_driver.py's.

def test_a_dead_engine_waits_for_the_driver_until_engine_restarts_are_spent():
    import threading

    from dapo_megatron.rollout.health import EngineHealth
    engines = ["engine0", "engine1"]  # handles, as far as the record goes
    health = EngineHealth(engines, max_restarts=1)
    health.report(1, RuntimeError("The actor died unexpectedly before finishing this task.\nRay's detail"), 3)
    assert health.alive(0) and not health.alive(1)
    (death,) = health.wait_dead(timeout=0)
    assert (death.engine, death.cause, death.in_flight) == (1, "The actor died unexpectedly before finishing this task.", 3)
    assert health.wait_dead(timeout=0) == []  # handed over once
    threading.Timer(0.2, health.replace, (1, "engine1-restart1")).start()
    health.wait_alive(any_of=False)  # the manager's wait before it hands the batch over
    assert engines == ["engine0", "engine1-restart1"] and health.alive(1)
    with pytest.raises(roles.RoleDied, match=r"^the rollout engine died: gone; restart the run.*"
                                             r"\(rollout.max_engine_restarts=1: every restart spent\)$"):
        health.report(0, RuntimeError("gone"), 1)


def test_no_engine_restarts_is_todays_error():
    """rollout.engine_timeout_s alone: a hung engine stops the run with today's error."""
    from dapo_megatron.rollout.health import EngineHealth
    health = EngineHealth(["engine0"], max_restarts=0, timeout_s=30.0)
    with pytest.raises(roles.RoleDied) as err:
        health.report(0, "no finished group for 31 s with 8 requests in flight (rollout.engine_timeout_s=30)", 8)
    assert str(err.value) == ("the rollout engine died: no finished group for 31 s with 8 requests in flight "
                              "(rollout.engine_timeout_s=30); restart the run, it resumes from the last checkpoint "
                              "(trainer.resume_mode=auto)")


@pytest.mark.parametrize("key", ["rollout.max_engine_restarts", "rollout.engine_timeout_s"])
def test_negative_engine_keys_are_refused_naming_them(tmp_path, key):
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", [f"{key}=-1", f"trainer.default_local_dir={tmp_path}"])
    assert err.value.key == key


def test_a_dead_role_crosses_ray_whole():
    """Raised in the rollout manager, a RoleDied reaches the driver pickled: the same message and
    fields (its args), not the message twice."""
    import pickle
    died = roles.died("rollout engine", RuntimeError("gone.\ndetail"), "rollout.max_engine_restarts=2")
    back = pickle.loads(pickle.dumps(died))
    assert (back.what, back.spent, str(back)) == ("the rollout engine died: gone", "rollout.max_engine_restarts=2",
                                                 str(died))
    assert str(died).endswith("(trainer.resume_mode=auto) (rollout.max_engine_restarts=2: every restart spent)")


def test_a_role_dead_at_start_up_takes_its_ray_with_it(tmp_path, monkeypatch):
    """A role dying in setup.prepare (e.g. a rank's set-up) shuts Ray down before the restart, or
    the restart's placement group would wait for the devices the first one still holds."""
    shutdowns = []

    def prepare(*args):
        raise roles.RoleDied(WHAT)
    monkeypatch.setattr(supervisor.setup, "prepare", prepare)
    monkeypatch.setattr(supervisor.setup, "restart_training", prepare)
    monkeypatch.setattr(supervisor.ray, "shutdown", lambda: shutdowns.append(1))
    with pytest.raises(roles.RoleDied):
        supervisor.attempt(_cfg(tmp_path, 1))
    with pytest.raises(roles.RoleDied):  # new ranks beside kept roles: the same
        supervisor.attempt(_cfg(tmp_path, 1), kept=supervisor.Kept(None, None, 0), may_keep=True)
    assert shutdowns == [1, 1]


def test_the_cluster_a_run_joins(tmp_path, monkeypatch):
    """RAY_ADDRESS wins; `local` and an empty one with no `ray start` record start a Ray of the
    run's own; a record whose GCS no longer runs here (a head killed without `ray stop`) is not
    joined. A live head's record is joined: tests/e2e/test_driver.py's `ray start` head."""
    from dapo_megatron.driver.placement import cluster_address
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert cluster_address() == "10.0.0.1:6379"
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert cluster_address() is None
    monkeypatch.delenv("RAY_ADDRESS")
    assert cluster_address() is None
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")  # no GCS listens there
    assert cluster_address() is None
    monkeypatch.setattr("ray._private.services.find_gcs_addresses", lambda: {"127.0.0.1:1"})  # as if it ran
    assert cluster_address() == "127.0.0.1:1"


def test_a_role_that_did_not_start_is_not_restarted_and_says_why_in_one_line(tmp_path, monkeypatch, capsys):
    """An actor whose __init__ raised (Ray's text of its creation task: the class, vLLM's pydantic
    message) is StartFailed, not RoleDied: restarts would fail alike, so none is made, and the
    command's one line is the library's message with the keys that set what it names."""
    from ray.exceptions import RayActorError

    from dapo_megatron import main as cli
    trace = ("The actor died because of an error raised in its creation task, \x1b[36mray::dapo-engine-0:EngineActor."
             "__init__()\x1b[39m (pid=1, ip=127.0.0.1)\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
             "pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig\n  Value error, "
             "max_num_batched_tokens (8) must be greater than or equal to max_num_seqs (64). [type=value_error]\n")
    # a death with no creation error stays a death
    assert isinstance(roles.died("rollout engine", RayActorError(None, "The actor died unexpectedly")), roles.RoleDied)
    exc = RayActorError(None, trace, actor_init_failed=True)
    failed = roles.died("actor the rollout manager called", exc)
    assert isinstance(failed, roles.StartFailed) and str(failed) == (
        "the rollout engine did not start: max_num_batched_tokens (8) must be greater than or equal to max_num_seqs "
        "(64) (set by rollout.max_num_batched_tokens, rollout.max_concurrent_per_engine)")
    assert str(roles.start_failed("training rank 0", "ray::TrainWorker.__init__()\nTraceback\n  File\n"
                                  "OSError: [Errno 2] No such file: '/m/config.json'")) == \
        "the training rank did not start: OSError: [Errno 2] No such file: '/m/config.json'"
    attempts = []

    def attempt(cfg, kept=None, may_keep=False):
        attempts.append(cfg)
        raise failed
    monkeypatch.setattr(supervisor, "attempt", attempt)
    monkeypatch.setattr(cli, "check_inputs", lambda cfg: None)
    assert cli.main(["--config-name", "quickstart", "trainer.max_restarts=2", f"trainer.default_local_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert len(attempts) == 1 and [line for line in err.splitlines() if line.startswith("error:")] == [f"error: {failed}"]


def test_a_role_killed_for_host_memory_is_one_line_naming_it():
    """Ray's memory monitor kills a role (or what it called): one RoleDied naming the role and the
    monitor's first line (the node's memory), not Ray's traceback."""
    import ray

    def oom():
        raise ray.exceptions.OutOfMemoryError("1 worker(s) were killed due to the node running low on memory. "
                                              "Memory on the node was 22.63GB used / 23.54GB limit\nTop 10 ...")
    with pytest.raises(roles.RoleDied) as err:
        roles.as_role("rollout engine", oom)
    try:
        oom()
    except ray.exceptions.OutOfMemoryError as exc:  # a training rank's call (driver/workers.py)
        assert roles.died("training rank 0", exc).what.startswith("the training rank 0 was killed by Ray for lack of")
    assert str(err.value.what) == ("the rollout engine was killed by Ray for lack of host memory: 1 worker(s) were "
                                   "killed due to the node running low on memory. Memory on the node was 22.63GB "
                                   "used / 23.54GB limit"), err.value.what
