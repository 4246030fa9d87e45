"""bench/async_sim.py drives the real rollout manager and the real `Trainer.train_step` with timed
stand-ins: a change to either's interface fails here, not in the next bench run. Ray takes
longer to start than this test may (~7 s on a busy 2-core machine), so its actors run in this
process: `.remote()` on a thread pool per actor (one per concurrency group, Ray's sizes), a
future for an ObjectRef."""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import importlib.util
import json
import os
import sys
import time

import pytest
import ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
# Virtual time per wall second for the tests whose asserts compare the simulated policy's timings:
# at 10x a loaded machine's own Python overhead (three busy threads on two cores) outran the
# simulated steps and both tests failed; at 4x a step's virtual seconds still dwarf that overhead.
TIMED_SPEEDUP = 4.0


def _load(name: str):
    sys.path.insert(0, BENCH)  # the scripts import their neighbours (common, results) by name
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class _Actor:
    def __init__(self, instance, options: dict):
        self._instance = instance
        groups = options.get("concurrency_groups") or {}
        self._pools = {None: cf.ThreadPoolExecutor(options.get("max_concurrency", 1))}
        self._pools.update({g: cf.ThreadPoolExecutor(n) for g, n in groups.items()})

    def __getattr__(self, name: str):
        method = getattr(self._instance, name)
        pool = self._pools[getattr(method, "__ray_concurrency_group__", None)]
        return type("Method", (), {"remote": staticmethod(lambda *a, **kw: pool.submit(method, *a, **kw))})

    def kill(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)


def _get(refs, timeout=None):
    if isinstance(refs, list):
        return [_get(r, timeout) for r in refs]
    try:
        return refs.result(timeout)
    except cf.TimeoutError:
        raise ray.exceptions.GetTimeoutError() from None


def _wait(refs, num_returns=1, timeout=None):
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        done = [r for r in refs if r.done()]
        left = None if end is None else end - time.monotonic()
        if len(done) >= num_returns or (left is not None and left <= 0):
            return done[:num_returns], [r for r in refs if r not in done[:num_returns]]
        cf.wait([r for r in refs if not r.done()], timeout=left, return_when=cf.FIRST_COMPLETED)


@pytest.fixture
def in_process_ray(monkeypatch):
    actors = []

    def remote(**options):
        def wrap(cls):
            def start(*a, **kw):
                actors.append(_Actor(cls(*a, **kw), options))
                return actors[-1]
            return type("ActorClass", (), {"remote": staticmethod(start)})
        return wrap
    monkeypatch.setattr(ray, "remote", remote)
    monkeypatch.setattr(ray, "get", _get)
    monkeypatch.setattr(ray, "wait", _wait)
    monkeypatch.setattr(ray, "kill", lambda actor, **_: None)
    yield
    for actor in actors:
        actor.kill()


def _tiny(sim, update_s: float = 0.4):
    return sim.Cluster(engines=1, slots=16, a=0.02, b=1e-4, p0=0.01, p_tok=1e-5, prompt_len=(8, 16), length_median=20.0,
                       length_sigma=0.5, solve=(1.0, 1.0), logprob_s=(0.2, 0.0), update_s=(update_s, 0.0), sync_s=0.2,
                       score_s=0.001, overrides=("data.train_batch_size=4", "data.gen_batch_size=6",
                                                 "actor.ppo_mini_batch_size=4", "rollout.n=4",
                                                 "data.max_response_length=64"))


def test_async_sim_runs_the_trainer_loop(in_process_ray, tmp_path, monkeypatch):
    sim = _load("async_sim")
    results = sys.modules["results"]
    monkeypatch.setattr(results, "machine_speed", lambda: {"python_loop_s": 0.0})  # a second of timing loops
    tiny = _tiny(sim)
    runs, simulate = [], sim.simulate  # the rows of each mode's run, as large_table gets them
    monkeypatch.setattr(sim, "simulate", lambda *a, **kw: runs.append(simulate(*a, **kw)) or runs[-1])
    steps = sim.WARMUP + 1  # the fewest large_table reports on
    table = sim.large_table(steps, 100.0, 1, cluster=tiny, modes={"async k=2": sim.MODES["async k=2"]})

    (rows,) = runs
    assert len(rows) == steps
    for r in rows:  # virtual seconds: each step at least its update, the stand-in's model time
        assert r["timing/step"] >= tiny.update_s[0] * 0.9
        assert r["sampling/kept_groups"] >= 4 and r["sim/kept_responses"] == 4 * r["sampling/kept_groups"]
        assert 0 <= r["rollout/staleness_max"] <= 2 and r["sim/engine_busy"] >= 0
    assert rows[0]["rollout/staleness_max"] == 0 < max(r["rollout/staleness_max"] for r in rows)  # async: lag after a push
    assert sum(r["sim/engine_busy"] for r in rows) > 0
    (row,) = table.rows
    assert row[0] == "async k=2" and row[2] == "1.00x" and float(row[1]) > 0  # responses/s
    path = results.write("async_sim", title="t", measures=sim.MEASURES, tables=[table], results_dir=str(tmp_path))
    doc = json.load(open(path))
    assert all(doc[k] for k in results.REQUIRED) and doc["tables"][0]["id"] == "large"
    assert len(doc["tables"][0]["columns"]) == len(doc["tables"][0]["rows"][0]) == 12


def test_the_stale_share_is_bounded_with_a_slow_trainer(in_process_ray):
    """trainer.stale_share=0.25 (verl's staleness_threshold) of a 4-group batch: one group may start
    before the push its batch trains after. The trainer takes 3 s (virtual) a step, the engine ~0.1 s a
    group, so without the bound the whole next batch would be generated stale meanwhile (async at
    max_staleness 1); with it the manager starts one, holds the other prompts for the push (the
    driver's `pushed`), and aborts the carried groups past the quota when a collection starts (a
    share of 0: every one)."""
    sim = _load("async_sim")
    mode = [*sim.MODES["async k=1"], "trainer.stale_share=0.25"]
    # an update of 0.75 s of the clock against generation of a few ms (TIMED_SPEEDUP)
    bounded, free, none = (sim.simulate(_tiny(sim, update_s=3.0), m, 6, TIMED_SPEEDUP, 1)
                           for m in (mode, sim.MODES["async k=1"], [*sim.MODES["async k=1"], "trainer.stale_share=0"]))

    shares = [r["rollout/stale_share"] for r in bounded]
    assert max(shares) <= 0.25 and shares[0] == 0.0, shares  # the driver would stop past it
    assert sum(r["timing/stale_hold"] for r in bounded) > 0  # prompts waited for a push
    assert max(r["rollout/stale_share"] for r in free) > 0.25  # the bound is what held it
    assert bounded[-1]["rollout/stale_responses_total"] == sum(round(s * 16) for s in shares)
    # a share of 0 (verl's on-policy streaming): the groups a full batch leaves running are all stale
    # for the next one, so its collection aborts them (their prompts back in the stream)
    assert all(r["rollout/stale_share"] == 0.0 for r in none) and sum(r["sampling/stale_aborted_groups"] for r in none) > 0


def test_the_calibration_table_has_one_measured_and_one_simulated_row_a_mode(monkeypatch):
    """The table's rows, not a simulation's, reach the results file (a simulated run's rows stand in:
    the table's assembly is under test), and its note and the index line are read off them."""
    sim = _load("async_sim")
    measured = json.load(open(sim.MEASURED))["modes"]
    keys = ("timing/step", "timing/gen", "timing/trainer_wait", "timing/update", "timing/sync", "timing/sync_wait",
            "timing/engine_idle_frac", "sampling/generated_groups")
    monkeypatch.setattr(sim, "simulate", lambda *a, **kw: [{k: 1.0 for k in keys}] * 3)
    table = sim.calibration_table(_tiny(sim), measured, 3, 1)
    assert [r[:2] for r in table.rows] == [pair for m in ("sync", "one_step_off", "async k=1", "async k=2")
                                           for pair in ([m, "measured"], ["", "simulated"])]
    assert all(len(r) == len(table.columns) for r in table.rows)
    note = sim.calibration_note(0.01, 1e-4, 3e-4, 0.1, 2e-3, 0.4, table.rows)
    errs = [int(r[2].split("(")[1].rstrip("%)")) for r in table.rows[1::2]]
    assert f"{min(errs):+d}% to {max(errs):+d}%" in note
    assert f"within {min(errs):+d}% to {max(errs):+d}%" in sim.summarize([{"id": "calibration", "rows": table.rows}])


def test_streamed_minibatches_train_while_the_step_generates(in_process_ray, monkeypatch):
    """trainer.stream_minibatches, sync mode: a 4-group batch in 4 mini-batches. Each trains (one
    update call, the schedule counting the step at the first) as soon as its group is scored,
    while the engine generates the others: the first update starts before the step's last group
    is in (timing/stream_overlap), and the parts, in order, are the whole batch."""
    sim = _load("async_sim")
    calls, wholes = [], []
    update = sim.SimTrain.step_update
    monkeypatch.setattr(sim.SimTrain, "step_update",
                        lambda self, step, first=True: calls.append((list(step.keys), first)) or update(self, step, first))
    from dapo_megatron.driver import trainer
    metrics = trainer.batch_metrics
    monkeypatch.setattr(trainer, "batch_metrics", lambda batch, *a: wholes.append(list(batch.keys)) or metrics(batch, *a))
    # long responses (median 100 tokens at ~20 ms a decode step, virtual) against a 0.3 s update;
    # every group kept (the filter off): four parts a step
    cluster = dataclasses.replace(_tiny(sim, update_s=0.3), length_median=100.0, length_sigma=0.8,
                                  overrides=(*_tiny(sim).overrides, "actor.ppo_mini_batch_size=1",
                                             "data.max_response_length=400", "algorithm.filter_groups.enable=false"))
    rows = sim.simulate(cluster, [*sim.MODES["sync"], "trainer.stream_minibatches=true"], 3, 10.0, 1)

    assert len(rows) == 3 and len(calls) == 12 and len(wholes) == 3
    assert [first for _, first in calls] == [True, False, False, False] * 3
    for s, whole in enumerate(wholes):
        assert [k for keys, _ in calls[4 * s:4 * s + 4] for k in keys] == whole and len(whole) == 16
    assert all(r["timing/stream_overlap"] > 0 for r in rows), [r["timing/stream_overlap"] for r in rows]
    assert all(r["rollout/staleness_max"] == 0 for r in rows)  # sync: one push a step, after its last update


def test_admission_by_running_responses_fills_the_engines_slots(in_process_ray, monkeypatch):
    """rollout.admission=responses: a group's finished responses free their slots, so the engine
    takes a new group once n are free. Long-tailed lengths (lognormal sigma 1), async at staleness
    2 (enough groups wanted): the engine runs more responses at once than when each group holds its
    n slots to its end, and never more unfinished ones than rollout.max_concurrent_per_engine."""
    sim = _load("async_sim")
    seen = []  # unfinished responses on the engine as each group arrives, and the group's n
    submit = sim.SimEngine.submit
    monkeypatch.setattr(sim.SimEngine, "submit", lambda self, rid, prompt, sampling, *a, **kw:
                        seen.append(self.running() + sampling.n) or submit(self, rid, prompt, sampling, *a, **kw))
    cluster = dataclasses.replace(_tiny(sim, update_s=0.5), length_median=40.0, length_sigma=1.0,
                                  overrides=(*_tiny(sim).overrides, "data.max_response_length=400",
                                             "rollout.max_concurrent_per_engine=16"))
    runs = {}
    for admission in ("groups", "responses"):
        seen.clear()
        rows = sim.simulate(cluster, [*sim.MODES["async k=2"], f"rollout.admission={admission}"], 5, TIMED_SPEEDUP, 1)
        runs[admission] = (sum(r["sim/concurrency"] for r in rows) / len(rows), max(seen))
    assert runs["responses"][1] <= 16 == runs["groups"][1], runs  # 4 groups of 4 at most
    assert runs["responses"][0] > 1.2 * runs["groups"][0], runs


def test_a_streamed_step_that_fails_releases_its_rows_after_its_collection(in_process_ray, monkeypatch):
    """The first mini-batch's update fails (a rank died): the step's collection is still writing
    into its partition, so the trainer releases the partition only once the collection is done."""
    sim = _load("async_sim")
    monkeypatch.setattr(sim.SimTrain, "step_update", lambda self, step, first=True: (_ for _ in ()).throw(
        RuntimeError("the rank died")))
    released = []  # (partition, whether its step's collection was still running)
    release = sim.SimManager.release

    def recorded(self, partition):
        released.append((partition, bool(self.streams)))
        return release(self, partition)
    recorded.__ray_concurrency_group__ = release.__ray_concurrency_group__  # beside the collecting calls, as Ray runs it
    monkeypatch.setattr(sim.SimManager, "release", recorded)
    cluster = dataclasses.replace(_tiny(sim), length_median=100.0, length_sigma=0.8,
                                  overrides=(*_tiny(sim).overrides, "actor.ppo_mini_batch_size=1",
                                             "data.max_response_length=400", "algorithm.filter_groups.enable=false"))
    with pytest.raises(RuntimeError, match="the rank died"):
        sim.simulate(cluster, [*sim.MODES["sync"], "trainer.stream_minibatches=true"], 1, 10.0, 1)
    assert released == [("step1-1", False)], released
