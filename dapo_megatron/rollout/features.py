"""The request features of an engine, each a `Feature` (rollout/requests.py) and a row of
`features_for`: images of vision-language prompts, routed experts, tool turns (multiturn.py),
segments (a deterministic run's partial rollouts)."""
from __future__ import annotations

from typing import Callable

import numpy as np

from dapo_megatron.batch import Prompt
from dapo_megatron.rollout.engine_spec import EngineSpec
from dapo_megatron.rollout.multiturn import ToolTurns
from dapo_megatron.rollout.requests import Feature, Requests, _Live


def features_for(spec: EngineSpec, requests: Requests, post: Callable[[Callable], None]) -> dict[str, Feature]:
    """The features `spec` turns on, by name. post(fn): run fn on the engine's loop thread."""
    on = {"images": Images(spec),  # a text-only engine refuses image prompts
          "routes": RoutedExperts(spec.num_layers, spec.top_k) if spec.return_routes else None,
          "tools": ToolTurns(spec, requests, post) if spec.multi_turn else None,
          "segments": Segments(requests)}  # idle unless a request's sampling asks for segments
    return {name: f for name, f in on.items() if f is not None}


class Images(Feature):
    """Prompts with images: ONE image token per image in the request; vLLM expands each to its
    grid's tokens. The group carries the pixels, the grids and the expanded prompt (what the
    trainer trains on), computed here with vLLM's image processor (device/vision.py)."""

    def __init__(self, spec: EngineSpec):
        self.max_images, self.pad = spec.max_images, spec.image_token_id
        self.processor = None
        if self.max_images:
            from dapo_megatron.device.vision import load_image_processor
            self.processor = load_image_processor(spec.model_path)

    def on_add(self, live: _Live, prompt: Prompt) -> None:
        if not prompt.images:
            return
        self._check(live.group.request_id, prompt)
        from dapo_megatron.data.images import open_image
        from dapo_megatron.device.vision import pixel_inputs
        images = [open_image(im) for im in prompt.images]  # refs -> pixels, here, not in the driver
        g = live.group
        g.pixel_values, grids = pixel_inputs(self.processor, images)
        g.image_grid_thw = grids.tolist()
        # Expanded here too, so that a group aborted before its prefill carries ids that match its
        # images; vLLM's outputs then confirm it (on_output).
        g.prompt = self.expand_pads(g.prompt, g.image_grid_thw)
        live.inputs["multi_modal_data"] = {"image": images}

    def on_output(self, live: _Live, i: int, out, logprobs: list[float]) -> None:
        if "multi_modal_data" in live.inputs and out.prompt_token_ids:
            live.group.prompt = list(out.prompt_token_ids)

    def _check(self, request_id: str, prompt: Prompt) -> None:
        if not self.max_images:
            raise ValueError(f"request {request_id!r} has images; this engine serves a text-only model")
        if len(prompt.images) > self.max_images:
            raise ValueError(f"request {request_id!r} has {len(prompt.images)} images, more than "
                             f"rollout.max_images_per_prompt ({self.max_images}); raise it")
        pads = sum(1 for t in prompt.ids if t == self.pad)
        if pads != len(prompt.images):
            raise ValueError(f"request {request_id!r} has {len(prompt.images)} images but {pads} image tokens; "
                             f"the chat template must write one <|image_pad|> per image")

    def expand_pads(self, ids: list[int], grids: list[list[int]]) -> list[int]:
        """Image pad i -> t * h * w / merge^2 pads (grids[i]), as vLLM's Qwen-VL processor does."""
        merge = self.processor.merge_size
        counts, out = iter(t * h * w // merge ** 2 for t, h, w in grids), []
        for token in ids:
            out.extend([self.pad] * next(counts) if token == self.pad else [token])
        return out


class RoutedExperts(Feature):
    """actor.router_replay=rollout: each response keeps the experts vLLM routed its prompt and
    response tokens to, [prompt + response - 1, layers, top_k] int16 (expert ids < 32768)."""

    def __init__(self, num_layers: int, top_k: int):
        self.layers, self.top_k = num_layers, top_k

    def on_add(self, live: _Live, prompt: Prompt) -> None:
        live.group.routed_experts = [None] * len(live.children)

    def on_finish(self, live: _Live, i: int, completion) -> bool:
        routes = completion.routed_experts
        # None: aborted before its prefill; all -1 positions then, the actor's router chooses.
        live.group.routed_experts[i] = (np.full((0, self.layers, self.top_k), -1, dtype=np.int16) if routes is None
                                        else np.asarray(routes).astype(np.int16))
        return False


class Segments(Feature):
    """trainer.deterministic with partial rollouts (Sampling.segment_tokens): before the policy
    version its batch trains from (Sampling.free_version), a response generates at most
    segment_tokens tokens under each version, then is held until the next push sends it on: a
    new request whose prompt is the prompt and the tokens so far (its seed from them, so a held
    response goes on the same way in every run). Where a push lands in a response is then fixed
    by the step, not by timing; the trainer pushes once every response is held or finished
    (`Engine.waiting_for_push`)."""

    def __init__(self, requests: Requests):
        self.requests = requests
        self.held: dict[str, list[int]] = {}  # group id -> its children waiting for the push
        self.ended = False  # `end`: no push will come (until the next: a restart that kept the engine)

    def on_add(self, live: _Live, prompt: Prompt) -> None:
        if live.sampling.segment_tokens:
            live.state["segment_ids"] = list(prompt.ids)  # as vLLM takes them (one pad per image)
            live.max_tokens = self._budget(live, 0)
            live.state["segment_ends"] = [live.max_tokens] * len(live.children)

    def _budget(self, live: _Live, i: int) -> int:
        s = live.sampling
        left = s.max_tokens - len(live.group.responses[i])
        return left if self.ended or self.requests.version >= s.free_version else min(s.segment_tokens, left)

    def on_finish(self, live: _Live, i: int, completion) -> bool:
        """Held: the request ended at its segment's end, short of the response's max_tokens (a
        stop token, or vLLM's own length limit, ends the response)."""
        s, length = live.sampling, len(live.group.responses[i])
        if not s.segment_tokens or completion.finish_reason != "length" or length >= s.max_tokens \
                or length != live.state["segment_ends"][i]:
            return False
        live.children[i] = None
        self.held.setdefault(live.group.request_id, []).append(i)
        return True

    def on_done(self, live: _Live, i: int) -> None:
        held = self.held.get(live.group.request_id, [])
        if i in held:  # aborted while held
            held.remove(i)

    def on_version(self, version: int) -> None:
        self.ended = False
        self._send_on()

    def _send_on(self) -> None:
        """Every held response on to its next segment's end (or its own)."""
        held, self.held = self.held, {}
        for group_id, children in held.items():
            live = self.requests.live.get(group_id)
            for i in children if live is not None else ():
                budget = self._budget(live, i)
                live.state["segment_ends"][i] = len(live.group.responses[i]) + budget
                self.requests.submit_child(live, i, f"{group_id}#{i}@{len(live.group.responses[i])}",
                                           live.state["segment_ids"] + live.group.responses[i], budget)

    def end(self) -> None:
        """The run stops with batches asked ahead: no push will come, held responses go on to their end."""
        self.ended = True
        self._send_on()

    def waiting_version(self) -> int | None:
        """The version under which responses are held for the next push and none generates."""
        return self.requests.version if any(self.held.values()) and not self.requests.generating() else None
