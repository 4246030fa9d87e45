"""The request features of an engine, each a `Feature` (rollout/requests.py) and a row of
`features_for`: images of vision-language prompts, routed experts, tool turns (multiturn.py)."""
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
          "tools": ToolTurns(spec, requests, post) if spec.multi_turn else None}
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
