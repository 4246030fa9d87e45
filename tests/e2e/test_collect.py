"""Both dynamic-sampling modes on a real vLLM-CPU engine actor with the data plane: the kept batch
has exactly train_batch_size groups, degenerate groups are dropped, no prompt is lost across an
abort (also of multi-turn conversations with a slow tool), the data plane holds exactly the kept
rows, and the driver gets metadata only."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e

N = 2
TRAIN, GEN = 4, 6


@pytest.fixture(scope="module")
def env(tiny_assets, local_ray):
    ray = local_ray
    from transformers import AutoTokenizer

    from dapo_megatron import dataplane
    from dapo_megatron.config.schema import DataPlaneConfig, RolloutConfig
    from dapo_megatron.data.dataset import PromptDataset
    from dapo_megatron.rollout.actor import engine_actor
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_assets / "tokenizer"))
    dataset = PromptDataset([str(tiny_assets / "data" / "train.parquet")], tokenizer, prompt_key="prompt",
                            max_prompt_length=64, truncation="filter", skip_bad_rows=False)
    handle = dataplane.start(DataPlaneConfig())
    from dapo_megatron.rollout.engine_spec import EngineSpec
    spec = EngineSpec.from_model(str(tiny_assets / "qwen3_moe"), RolloutConfig(enforce_eager=True), dtype="fp32",
                                 max_model_len=512)
    engine = engine_actor(spec, device="cpu", num_cpus=1, data_plane=handle)
    yield dataset, engine, dataplane.connect(handle), handle
    ray.get(engine.shutdown.remote())
    ray.kill(engine)
    dataplane.stop()


@pytest.fixture(scope="module")
def tool_env(env, tool_assets):
    """A second engine actor on env's Ray (its spare CPU) and data plane: multi-turn, the warmed-up
    tool model, its `python` tool answering 0.3-2 s late (slow_tool.py)."""
    import ray
    from transformers import AutoTokenizer

    from dapo_megatron.config.schema import MultiTurnConfig, RolloutConfig
    from dapo_megatron.data.dataset import PromptDataset
    from dapo_megatron.rollout.actor import engine_actor
    from dapo_megatron.toolcall import load_tools
    tools = [f"{Path(__file__).parent / 'slow_tool.py'}:python"]
    tokenizer = AutoTokenizer.from_pretrained(tool_assets / "qwen2")
    dataset = PromptDataset([str(tool_assets / "data" / "train.parquet")], tokenizer, prompt_key="prompt",
                            max_prompt_length=64, truncation="error", skip_bad_rows=False,
                            tools=[t.schema for t in load_tools(tools).values()])  # as driver/setup.py does
    cfg = RolloutConfig(enforce_eager=True, seed=0, multi_turn=MultiTurnConfig(enable=True, max_turns=3), tools=tools)
    from dapo_megatron.rollout.engine_spec import EngineSpec
    spec = EngineSpec.from_model(str(tool_assets / "qwen2"), cfg, dtype="fp32", max_model_len=256)
    engine = engine_actor(spec, device="cpu", num_cpus=1, data_plane=env[3])
    ray.get(engine.num_in_flight.remote())  # started
    yield tokenizer, dataset, engine, env[2]
    ray.get(engine.shutdown.remote())
    ray.kill(engine)


class RecordingSampler:
    """The real PromptSampler, recording every index it hands out."""

    def __init__(self, n, seed=3):
        from dapo_megatron.data.sampler import PromptSampler
        self.inner, self.served, self.returned = PromptSampler(n, shuffle=True, seed=seed), [], []

    def next(self, k):
        out = self.inner.next(k)
        self.served += out
        return out

    def push_back(self, indices):
        self.returned += indices
        self.inner.push_back(indices)


def half_degenerate(items, groups):
    """Even dataset indices: every response 'correct' (a group with no signal); odd: mixed."""
    from dapo_megatron.algo import Group
    from dapo_megatron.rollout.collection import ScoredGroup
    out = []
    for item, group in zip(items, groups):
        n = len(group.keys)
        acc = torch.ones(n) if item.index % 2 == 0 else (torch.arange(n) % 2).float()
        out.append(Group(acc.tolist(), ScoredGroup(item, group, acc * 2 - 1, acc.bool())))
    return out


def _check_kept(result, plane, partition):
    """The kept batch, and the data plane holding its rows and nothing else (filtered and aborted
    groups cleared at once); the driver received metadata only: tens of bytes per response."""
    from dapo_megatron.dataplane import read_batch
    from dapo_megatron.rollout.collection import groups_to_batch
    assert len(result.groups) == TRAIN
    assert all(g.payload.item.index % 2 == 1 for g in result.groups)
    step = groups_to_batch(result.groups, partition)
    assert len(step) == TRAIN * N and step.group == [i // N for i in range(TRAIN * N)]
    assert sorted(plane._tq.kv_list(partition).get(partition, {})) == sorted(step.keys)
    batch = read_batch(plane, step, list(range(len(step))), ["prompts", "responses", "rollout_logprobs"])
    assert batch.response_lengths.tolist() == [s - len(p) for s, p in zip(step.sequence_lengths, batch.prompts)]
    assert result.metrics["driver/bytes"] / result.metrics["sampling/scored_responses"] < 400
    plane.clear(partition)
    return batch


def test_the_engine_process_runs_in_the_device_layers_environment(env):
    """Set before vLLM's import in the engine's own process (runtime env), not the caller's: the
    oneDNN cache capacity, for one, is read once at the first kernel, glibc's arena limit at the
    process's first allocation."""
    import ray

    from dapo_megatron.device import get_device
    want = {**get_device("cpu").host_env(), **get_device("cpu").vllm_env(1)}
    got = ray.get(env[1].__ray_call__.remote(lambda self: {k: os.environ.get(k) for k in want}))
    assert got == want and want["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0" and want["MALLOC_ARENA_MAX"] == "1"


def test_sync_mode_keeps_exactly_train_batch_size(env):
    from dapo_megatron.algo import DynamicSampler
    from dapo_megatron.rollout.collection import Rounds, Source, Store
    from dapo_megatron.rollout.types import Sampling
    dataset, engine, plane, _ = env
    prompts = RecordingSampler(len(dataset))
    sampler = DynamicSampler(TRAIN, max_num_gen_batches=10)
    rounds = Rounds(Source([engine], dataset, prompts, sampler, half_degenerate, GEN))
    result = rounds.collect(1, Sampling(n=N, temperature=1.0, max_tokens=8, seed=0), Store("sync", plane))
    _check_kept(result, plane, "sync")
    assert len(prompts.served) == GEN * result.metrics["sampling/num_gen_batches"]
    assert result.metrics["sampling/discarded_tokens"] > 0  # the even groups were generated and dropped


def _early_stop_steps(engine, dataset, plane, sampling, partition, steps=3):
    """Early-stop collections, like consecutive steps (a fresh prompt stream each), until one
    aborted something; each is checked in full: the kept batch and the data plane, every prompt
    served either scored or back in the stream (never both, never twice), pushed-back prompts
    served first next time. Whether a group is still in flight when the batch fills is a matter
    of timing: a step in which every group came back in the same poll has nothing to abort, so
    the abort path gets up to `steps` chances. Returns the metrics of every step."""
    from dapo_megatron.algo import DynamicSampler
    from dapo_megatron.rollout.collection import EarlyStop, Source, Store
    out = []
    for step in range(steps):
        prompts, seen = RecordingSampler(len(dataset), seed=3 + step), []

        def scorer(items, groups):
            seen.extend(it.index for it in items)
            return half_degenerate(items, groups)

        source = Source([engine], dataset, prompts, DynamicSampler(TRAIN, max_num_gen_batches=10), scorer, GEN)
        result = EarlyStop(source, max_concurrent_per_engine=4 * N).collect(step + 1, sampling, Store(partition, plane))
        _check_kept(result, plane, partition)
        pushed = prompts.inner.state_dict()["pushed_back"]
        assert sorted(seen + pushed) == sorted(prompts.served) and len(set(seen)) == len(seen)
        assert prompts.next(len(pushed)) == pushed  # served first next time
        out.append(result.metrics)
        if result.metrics["sampling/aborted_groups"] >= 1 and result.metrics["sampling/aborted_tokens"] > 0:
            return out
    raise AssertionError(f"nothing was aborted in {steps} early-stop steps: {out}")


def test_early_stop_aborts_and_returns_every_unused_prompt(env):
    from dapo_megatron.rollout.types import Sampling
    dataset, engine, plane, _ = env
    # A small concurrency and stop tokens that end responses at random lengths: groups finish at
    # different times, so some are still in flight when the batch fills and must be aborted.
    sampling = Sampling(n=N, temperature=1.0, max_tokens=48, seed=0, stop_token_ids=tuple(range(100, 130)))
    _early_stop_steps(engine, dataset, plane, sampling, "early")


def test_in_order_early_stop_keeps_the_same_groups_whatever_finishes_first(env):
    """trainer.deterministic: early stop in waves scored in prompt order. The same prompt stream
    and seeds collected with 4 groups in flight and with 1 (other finish orders, other polls)
    keep the same groups with the same tokens and log-probs, every metric but the clocks equal,
    the same prompts back in the stream; nothing is aborted, the surplus of a wave dropped."""
    from dapo_megatron.algo import DynamicSampler
    from dapo_megatron.rollout.collection import EarlyStop, Source, Store
    from dapo_megatron.rollout.types import Sampling
    dataset, engine, plane, _ = env
    sampling = Sampling(n=N, temperature=1.0, max_tokens=48, seed=0, stop_token_ids=tuple(range(100, 130)))
    runs = []
    for groups_at_once in (4, 1):
        prompts = RecordingSampler(len(dataset), seed=5)
        source = Source([engine], dataset, prompts, DynamicSampler(TRAIN, max_num_gen_batches=10), half_degenerate, GEN)
        waves = EarlyStop(source, max_concurrent_per_engine=groups_at_once * N, in_order=True)
        result = waves.collect(1, sampling, Store(f"waves{groups_at_once}", plane))
        batch = _check_kept(result, plane, f"waves{groups_at_once}")
        runs.append(([g.payload.item.index for g in result.groups], batch.responses, batch.rollout_logprobs,
                     {k: v for k, v in result.metrics.items() if not k.startswith("timing/")},
                     prompts.inner.state_dict()["pushed_back"], prompts.served))
    (kept, responses, logprobs, metrics, back, served), other = runs
    assert kept == other[0] and len(responses) == len(logprobs) == TRAIN * N

    def rows_equal(a, b):  # tensors or lists of them, row by row, bit for bit
        return len(a) == len(b) and all(torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(a, b))
    assert rows_equal(responses, other[1]) and rows_equal(logprobs, other[2])
    assert metrics == other[3] and metrics["sampling/aborted_groups"] == 0
    assert back == other[4] and served == other[5]


def test_early_stop_carries_groups_in_flight_into_the_next_collection(env):
    """trainer.mode=async with partial rollouts: the groups still running when a batch fills go on
    (nothing aborted) and the next collection takes them over: they are stored in its partition
    and scored there; a take-over whose oldest allowed policy version is past theirs never scores
    them (dropped when they finish, aborted if the batch fills first: their prompts go back to the
    stream). Across the three collections every prompt served is scored or returned, once."""
    from collections import Counter

    from dapo_megatron.algo import DynamicSampler
    from dapo_megatron.rollout.collection import Carrying, Source, Staleness, Store
    from dapo_megatron.rollout.types import Sampling
    dataset, engine, plane, _ = env
    sampling = Sampling(n=N, temperature=1.0, max_tokens=48, seed=0, stop_token_ids=tuple(range(100, 130)))
    prompts, scored = RecordingSampler(len(dataset), seed=7), []

    def scorer(items, groups):
        scored.extend((it.index, g.request_id) for it, g in zip(items, groups))
        return half_degenerate(items, groups)

    # max_staleness 2: a group trained at step s may hold tokens of version s - 3
    carrying = Carrying(Source([engine], dataset, prompts, DynamicSampler(TRAIN, max_num_gen_batches=10), scorer, GEN),
                        max_concurrent_per_engine=4 * N, staleness=Staleness(2))

    def collect(partition, step):
        start = len(scored)
        result = carrying.collect(step, sampling, Store(partition, plane))
        _check_kept(result, plane, partition)  # carried groups stored in this partition, dropped ones not kept
        return result, {rid for _, rid in scored[start:]}

    first, _ = collect("carry1", 1)
    assert first.metrics["sampling/aborted_groups"] == 0 and carrying.carried is not None
    carried = set(carrying.carried.in_flight)
    assert first.metrics["sampling/carried_groups"] == len(carried) >= 1
    # what a checkpoint returns to the stream: the prompts served, neither scored nor given back
    assert Counter(it.index for it in carrying.in_flight()) == \
        Counter(prompts.served) - Counter(i for i, _ in scored) - Counter(prompts.returned)
    second, rids2 = collect("carry2", 3)  # oldest version allowed: 0
    assert carried & rids2, (carried, rids2)  # finished and scored in the next collection
    assert second.metrics["sampling/stale_groups"] == 0 and carrying.carried is not None
    carried2 = set(carrying.carried.in_flight)
    import ray
    ray.get(engine.begin_weight_update.remote())  # a push (of no tensors): what runs on is sampled by version 1
    ray.get(engine.finish_weight_update.remote(1))
    third, rids3 = collect("carry3", 4)  # oldest allowed: 1; the carried began under version 0
    assert not carried2 & rids3 and third.metrics["sampling/stale_groups"] <= len(carried2)
    if carrying.carried is not None:  # the run ends: what is still in flight is aborted, its prompts returned
        prompts.push_back([it.index for it in carrying.carried.abort_all()[0]])
    assert Counter(prompts.served) == Counter(i for i, _ in scored) + Counter(prompts.returned)


def test_a_batch_waits_for_the_stragglers_the_next_would_drop(env):
    """trainer.stale_strategy=wait: two long groups left running by a collection (its straggler
    state, set up directly: which groups a real one leaves running is timing) are still going
    under the old weights when the next batch fills with short new groups; that batch waits for
    them (polling them alone: the new groups finishing meanwhile stay in the engine for the
    collection after) and trains on them first. Nothing carried further is older than the next
    bound, so the collection after drops nothing; every prompt served is scored or returned, once."""
    from collections import Counter

    import ray

    from dapo_megatron.algo import DynamicSampler
    from dapo_megatron.rollout.collection import Carrying, Source, Staleness, Store, Stream
    from dapo_megatron.rollout.collection.base import Tokens
    from dapo_megatron.rollout.types import Sampling
    dataset, engine, plane, _ = env
    long = Sampling(n=N, temperature=1.0, max_tokens=440, seed=0, ignore_eos=True)
    short = Sampling(n=N, temperature=1.0, max_tokens=2, seed=0, ignore_eos=True)
    prompts, scored = RecordingSampler(len(dataset), seed=11), []

    def scorer(items, groups):
        scored.extend((it.index, g.request_id) for it, g in zip(items, groups))
        return half_degenerate(items, groups)

    source = Source([engine], dataset, prompts, DynamicSampler(TRAIN, max_num_gen_batches=10), scorer, GEN)
    # max_staleness 4 (room beside the stragglers for new groups); the batch at step s trains
    # tokens of version s - 5 and later
    waiting = Carrying(source, max_concurrent_per_engine=16 * N, staleness=Staleness(4, wait=True))

    def collect(carrying, partition, oldest_version):
        start = len(scored)
        result = carrying.collect(oldest_version + 5, short, Store(partition, plane))
        _check_kept(result, plane, partition)
        return result, {rid for _, rid in scored[start:]}

    def push(version):  # (of no tensors)
        ray.get(engine.begin_weight_update.remote())
        ray.get(engine.finish_weight_update.remote(version))

    v = 100  # the module's engine has had pushes of other tests
    push(v)
    stragglers = Stream([engine], long, 16 * N, Tokens(Store("wait1", plane)))
    stragglers.queued.extend(dataset[i] for i in prompts.next(2))
    stragglers.submit_ready(2)
    carried = set(stragglers.in_flight)
    push(v + 1)  # the batch before trained: max_staleness 1 lets the next batch train version v, not later ones
    assert set(ray.get(engine.oldest_versions.remote(list(carried))).values()) == {v}
    waiting.carried = stragglers  # the new groups fill the batch first
    second, rids2 = collect(waiting, "wait2", v)
    assert second.metrics["sampling/waited_groups"] == 2 and second.metrics["timing/stale_wait"] > 0
    assert carried <= rids2, carried - rids2  # scored here, none left to drop
    trained = {g.payload.rollout.request_id for g in second.groups}
    assert {rid for i, rid in scored if rid in carried and i % 2} <= trained  # the kept ones in the batch
    held = set(waiting.carried.in_flight) if waiting.carried is not None else set()
    assert min(ray.get(engine.oldest_versions.remote(list(held))).values(), default=v + 1) == v + 1
    dropping = Carrying(source, max_concurrent_per_engine=16 * N, staleness=Staleness(4))
    dropping.carried = waiting.carried
    third, _ = collect(dropping, "wait3", v + 1)
    assert third.metrics["sampling/stale_groups"] == 0 and "sampling/waited_groups" not in third.metrics
    if dropping.carried is not None:  # the rest aborted, prompts returned
        prompts.push_back([it.index for it in dropping.carried.abort_all()[0]])
    assert Counter(prompts.served) == Counter(i for i, _ in scored) + Counter(prompts.returned)


def test_early_stop_multi_turn_with_a_slow_tool_returns_every_unused_prompt(tool_env):
    """Multi-turn, with a tool that answers 0.3-2 s late: conversations in flight when the batch
    fills (generating, or waiting on the tool) are aborted and their prompts go back to the stream
    like any other, none lost or scored twice; nothing stays in flight in the engine or the data plane."""
    import ray
    from dapo_megatron.rollout.types import Sampling
    tokenizer, dataset, engine, plane = tool_env
    # The tool tokenizer's eos is <|im_end|>: a turn ends there, and a tool call ends its turn.
    sampling = Sampling(n=N, temperature=1.0, max_tokens=96, seed=0, stop_token_ids=(tokenizer.eos_token_id,))
    metrics = _early_stop_steps(engine, dataset, plane, sampling, "tools")
    assert all(m["rollout/tool_calls"] > 0 and m["rollout/turns_mean"] > 1 for m in metrics)
    assert ray.get(engine.num_in_flight.remote()) == 0


class Replacements:
    """Spare real engine actors and a driver stand-in: a thread that starts a fresh engine for
    every death an `EngineHealth` reports and hands it over (the real driver also pushes the
    trainer's weights into it; here every engine holds the same HF weights)."""

    def __init__(self, spec, plane_handle, spares: int):
        from dapo_megatron.rollout.actor import engine_actor
        self.deaths, self.idle = [], []  # idle: a previous test's replacement
        # every spare the module's tests take, starting at once: their start-ups (~15 s of a core
        # each) overlap each other and the tests, instead of one after another on the critical path
        self.started = [engine_actor(spec, device="cpu", num_cpus=0, data_plane=plane_handle, name=f"spare-{i}")
                        for i in range(spares)]
        self.spares = list(self.started)

    def start(self):
        import ray
        if self.idle:
            return self.idle.pop()
        assert self.spares, "every spare engine taken: raise the fixture's `spares`"
        e = self.spares.pop(0)
        ray.get(e.num_in_flight.remote())
        return e

    def serve(self, health):
        import threading

        def serve():
            for death in health.wait_dead(timeout=120):
                self.deaths.append(death)
                health.replace(death.engine, self.start())
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        return thread


@pytest.fixture(scope="module")
def replacements(env, tiny_assets):
    import ray

    from dapo_megatron.config.schema import RolloutConfig
    from dapo_megatron.rollout.engine_spec import EngineSpec
    spec = EngineSpec.from_model(str(tiny_assets / "qwen3_moe"), RolloutConfig(enforce_eager=True), dtype="fp32",
                                 max_model_len=512)
    # the killed-engine test's victim and its replacement, the hung-engine test's replacement
    out = Replacements(spec, env[3], spares=3)
    yield out
    for e in out.started:
        ray.kill(e)


def _signal_engine_in(engine, sig, delay_s: float):
    """Send `sig` to the engine's process `delay_s` from now; returns (timer, pid)."""
    import os
    import threading

    import ray
    pid = ray.get(engine.pid.remote())
    timer = threading.Timer(delay_s, os.kill, (pid, sig))
    timer.start()
    return timer, pid


# Long responses (EOS ignored): the collection is still generating when the signal comes.
LONG = dict(n=N, temperature=1.0, max_tokens=160, seed=0, ignore_eos=True)


def test_sync_mode_generates_a_killed_engines_shard_again_on_its_replacement(env, replacements):
    """kill -9 of one of two engines 0.3 s into a round: its shard is generated again on the live
    one (the other's is kept), the batch is full, every served prompt scored exactly once, and the
    collection's engine list holds the replacement."""
    import signal

    from dapo_megatron.algo import DynamicSampler
    from dapo_megatron.rollout.collection import Rounds, Source, Store
    from dapo_megatron.rollout.health import EngineHealth
    from dapo_megatron.rollout.types import Sampling
    dataset, engine, plane, _ = env
    victim = replacements.start()
    engines = [engine, victim]
    health = EngineHealth(engines, max_restarts=1)
    server, before = replacements.serve(health), len(replacements.deaths)
    prompts, seen = RecordingSampler(len(dataset)), []

    def scorer(items, groups):
        seen.extend(it.index for it in items)
        return half_degenerate(items, groups)
    kill, _ = _signal_engine_in(engines[1], signal.SIGKILL, 0.3)
    source = Source(engines, dataset, prompts, DynamicSampler(TRAIN, max_num_gen_batches=10), scorer, GEN, health)
    result = Rounds(source).collect(1, Sampling(**LONG), Store("sync-killed", plane))
    kill.join()
    health.wait_alive(any_of=False)  # as the manager does before it hands the batch over
    server.join(timeout=5)
    _check_kept(result, plane, "sync-killed")
    (death,) = replacements.deaths[before:]
    assert death.engine == 1 and death.in_flight == GEN // 2, death  # its whole shard
    assert health.restarts == 1 and not health.dead and engines[1] is not victim
    assert sorted(seen) == sorted(prompts.served) and len(set(seen)) == len(seen)
    replacements.idle.append(engines[1])  # the next test's victim: one engine start less


def test_early_stop_requeues_a_hung_engines_prompts_and_kills_it(env, replacements):
    """SIGSTOP of one of two engines mid-generation (a hung driver call): after
    rollout.engine_timeout_s without an answer it is killed and reported with its in-flight
    prompts, which are generated on the replacement; none lost, none scored twice."""
    import signal

    import ray

    from dapo_megatron.algo import DynamicSampler
    from dapo_megatron.rollout.collection import EarlyStop, Source, Store
    from dapo_megatron.rollout.health import EngineHealth
    from dapo_megatron.rollout.types import Sampling
    dataset, engine, plane, _ = env
    victim = replacements.start()
    engines = [engine, victim]
    # 6 s: well past a healthy engine's time to finish a group here (64 tokens: ~1 s)
    health = EngineHealth(engines, max_restarts=1, timeout_s=6.0)
    server, before = replacements.serve(health), len(replacements.deaths)
    prompts, seen = RecordingSampler(len(dataset)), []

    def scorer(items, groups):
        seen.extend(it.index for it in items)
        return half_degenerate(items, groups)
    stop, pid = _signal_engine_in(victim, signal.SIGSTOP, 0.3)
    source = Source(engines, dataset, prompts, DynamicSampler(TRAIN, max_num_gen_batches=10), scorer, GEN, health)
    result = EarlyStop(source, max_concurrent_per_engine=4 * N).collect(
        1, Sampling(**{**LONG, "max_tokens": 64}), Store("early-hung", plane))
    stop.join()
    health.wait_alive(any_of=False)
    server.join(timeout=5)
    _check_kept(result, plane, "early-hung")
    (death,) = replacements.deaths[before:]  # only the stopped one: the live engine's silence while
    # the loop waited on the stopped one is not held against it
    assert death.engine == 1 and death.in_flight > 0 and "rollout.engine_timeout_s=6" in death.cause, death
    assert engines[1] is not victim and not health.dead
    pushed = prompts.inner.state_dict()["pushed_back"]
    assert sorted(seen + pushed) == sorted(prompts.served) and len(set(seen)) == len(seen)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(victim.pid.remote(), timeout=30)
    psutil = pytest.importorskip("psutil")  # its process killed, not left stopped
    deadline = time.monotonic() + 30
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the hung engine's process {pid} is still there"
        time.sleep(0.2)
