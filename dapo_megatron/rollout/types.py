"""What goes into and comes out of a rollout engine; plain data, no vLLM, so the driver and the
schedulers can import it without loading vLLM."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from dapo_megatron.batch import FIELDS, IMAGE, PLANE

# Finish reasons, as vLLM spells them: "stop" (EOS / stop token), "length" (max_tokens),
# "abort" (aborted by `Engine.abort`; the response holds the tokens generated until then).
FINISH_REASONS = ("stop", "length", "abort")


def row_prefix(engine: str, request_id: str) -> str:
    """What a group's data-plane keys begin with: "<engine>/<request id>/" then the response's
    index (or "images"), so the rows of a request are found by its id alone."""
    return f"{engine}/{request_id}/"


def request_of(key: str) -> str:
    """The request id of a row's key (`row_prefix`)."""
    return key.split("/")[1] if key.count("/") >= 2 else ""


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one generate / submit call (the n responses of a prompt share them)."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    seed: Optional[int] = None  # None: nondeterministic; else per response from (seed, prompt, i)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # sample past EOS and the stop tokens, to max_tokens
    # trainer.deterministic with partial rollouts (rollout/features.py's `Segments`): under each
    # policy version before `free_version` (the one its batch trains from) a response generates
    # at most segment_tokens tokens, then waits for the next push; 0: no segments
    segment_tokens: int = 0
    free_version: int = 0

    @classmethod
    def from_config(cls, cfg, max_tokens: int, seed: Optional[int] = None) -> "Sampling":
        """Training sampling from a `RolloutConfig` (rollout.n, rollout.temperature, ...)."""
        return cls(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                   max_tokens=max_tokens, seed=seed, ignore_eos=cfg.ignore_eos)

    @classmethod
    def validation(cls, cfg, max_tokens: int, seed: Optional[int] = None) -> "Sampling":
        """Validation sampling from `rollout.val_kwargs`."""
        v = cfg.val_kwargs
        return cls(n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k,
                   max_tokens=max_tokens, seed=seed)

    def child_seed(self, prompt: list[int], i: int) -> Optional[int]:
        """Seed of response i of `prompt`: reproducible, and different across prompts. With plain
        seed + i every prompt drew the same random numbers, and a near-uniform policy then gave
        nearly the same tokens for all prompts of a batch."""
        if self.seed is None:
            return None
        return zlib.crc32(f"{self.seed}:{i}:".encode() + bytes(str(prompt), "ascii")) & 0x7FFFFFFF


@dataclass
class RolloutGroup:
    """The n responses of one prompt (a `group`), returned once all n have finished."""
    request_id: str
    index: int  # position of the prompt in the `generate` call; the caller's value for `submit`
    prompt: list[int]  # the prompt's token ids as the engine ran them (what the actor trains on)
    responses: list[list[int]] = field(default_factory=list)  # [n][T_i] token ids
    rollout_logprobs: list[list[float]] = field(default_factory=list)  # [n][T_i] log p(token)
    finish_reasons: list[str] = field(default_factory=list)  # [n], one of FINISH_REASONS
    # [n] int16 arrays [positions, layers, top_k]: the experts the engine chose for each prompt
    # and response token (actor.router_replay=rollout); empty when the engine returns none.
    routed_experts: list = field(default_factory=list)
    # Multi-turn rollouts (rollout.multi_turn) only, else empty: [n][T_i] 1 on tokens the model
    # wrote, 0 on tool messages and the template around them; [n] model turns; the group's tool
    # accounting, summed over its responses (keys TOOL_STATS).
    loss_masks: list[list[int]] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    tool_stats: dict = field(default_factory=dict)
    # [n] per response, (policy version, index of its first token) of each run of tokens one version
    # of the weights sampled; more than one when a weight push came while it was generated.
    version_spans: list = field(default_factory=list)
    # Vision-language prompts only, else empty: [N_images][t, h, w] patch grids of the prompt's
    # images, in order; image i fills t * h * w / merge^2 of the `prompt`'s image tokens.
    image_grid_thw: list = field(default_factory=list)
    # ... and their patch rows [N_patches, C*T*P*P] from the engine's image processor (None: no images).
    pixel_values: Optional[torch.Tensor] = None

    TOOL_STATS = ("tool_calls", "tool_errors", "tool_timeouts", "tool_s")

    def route_positions(self, i: int) -> Optional[torch.Tensor]:
        """Response i's routes over its prompt + response positions, [P + R, layers, top_k] int16;
        -1 where the engine computed none (the last token is never fed back). None without routes."""
        if not self.routed_experts:
            return None
        routes = torch.as_tensor(self.routed_experts[i], dtype=torch.int16)  # [n_fed, layers, k]
        length = len(self.prompt) + len(self.responses[i])
        out = torch.full((length, *routes.shape[1:]), -1, dtype=torch.int16)
        n = min(length, routes.shape[0])
        out[:n] = routes[:n]
        return out

    @property
    def aborted(self) -> bool:
        return "abort" in self.finish_reasons

    def rows(self) -> list[dict]:
        """One data-plane row per response: the `batch.FIELDS` rows the engine writes, those this
        group has (loss mask: multi-turn; routes: engine routes). A new engine field is its FIELDS
        row plus a per-response column of that name here (or an entry in `_ROW_VALUES`)."""
        names = [n for n, f in FIELDS.items() if f.writer == "engine" and f.where == PLANE and f.scope != IMAGE]
        out = []
        for j in range(len(self.responses)):
            values = ((name, self._value(name, j)) for name in names)
            out.append({name: v for name, v in values if v is not None})
        return out

    def _value(self, name: str, j: int):
        """Response j's value of field `name`; None when the group has none."""
        if name in _ROW_VALUES:
            return _ROW_VALUES[name](self, j)
        column = getattr(self, name, None)
        return column[j] if column else None

    def image_row(self) -> Optional[dict]:
        """The data-plane row of the prompt's images (the IMAGE-scope fields), stored once for the
        n responses; None for a text prompt."""
        if self.pixel_values is None:
            return None
        return {n: torch.as_tensor(getattr(self, n)) for n, f in FIELDS.items() if f.scope == IMAGE}

    def stored(self, partition: str, keys: list[str], fields: tuple[str, ...] = (),
               image_key: str = "") -> "StoredGroup":
        """What the driver sees of this group once its rows (columns `fields`) are in the data plane
        (and its images under `image_key`)."""
        masks = self.loss_masks or [[1] * len(r) for r in self.responses]
        return StoredGroup(self.request_id, self.index, partition, keys, len(self.prompt),
                           [len(r) for r in self.responses], [int(sum(m)) for m in masks],
                           list(self.finish_reasons), list(self.turns), dict(self.tool_stats), fields, image_key,
                           *self._versions())

    @property
    def oldest_version(self) -> int:
        """The policy version of the group's oldest token (of its first, for a response not started)."""
        return min(spans[0][0] for spans in self.version_spans)

    def _versions(self) -> tuple[int, list]:
        """(the version every response was sampled by, []) when one was, else (0, the spans): what
        the manager receives per group stays one int unless a push split a response."""
        spans = {tuple(s) for s in self.version_spans}
        if len(spans) == 1 and len(next(iter(spans))) == 1:
            return next(iter(spans))[0][0], []
        return 0, [list(s) for s in self.version_spans]


# Engine fields whose value is not the group's column of the same name: the prompt (one per group,
# in every response's row), the multi-turn loss mask, the routes over prompt + response positions.
_ROW_VALUES = {
    "prompts": lambda g, j: g.prompt,
    "loss_mask": lambda g, j: g.loss_masks[j] if g.loss_masks else None,
    "routed_experts": lambda g, j: g.route_positions(j),
}


@dataclass
class StoredGroup:
    """A finished group whose tokens are in the data plane: keys and per-response metadata only,
    so what an engine returns to the driver does not grow with the response length."""
    request_id: str
    index: int
    partition: str
    keys: list[str]  # [n] data-plane keys of its responses
    prompt_length: int
    response_lengths: list[int]  # [n]
    loss_tokens: list[int]  # [n] tokens the loss sees (the response length unless tool turns)
    finish_reasons: list[str]
    turns: list[int] = field(default_factory=list)
    tool_stats: dict = field(default_factory=dict)
    fields: tuple[str, ...] = ()  # the columns stored per response
    image_key: str = ""  # the key of the prompt's image row (one for all n responses); "": none
    version: int = 0  # the policy version that sampled every response (when `version_spans` is empty)
    version_spans: list = field(default_factory=list)  # [n] RolloutGroup.version_spans, when they differ

    def versions(self, j: int) -> tuple[int, int]:
        """Response j's oldest and newest policy version."""
        if not self.version_spans:
            return self.version, self.version
        spans = self.version_spans[j]
        return spans[0][0], spans[-1][0]

    @property
    def oldest_version(self) -> int:
        """The policy version of the group's oldest token: what the staleness bound compares."""
        return min(self.versions(j)[0] for j in range(len(self.keys)))

    @property
    def data_keys(self) -> list[str]:
        """Every key the group holds in the data plane: its responses' and its image row's."""
        return self.keys + [self.image_key] if self.image_key else list(self.keys)

    @property
    def aborted(self) -> bool:
        return "abort" in self.finish_reasons
