"""The batch schema: ONE table of fields, and RolloutBatch, whose every operation iterates it.

A field has a scope, which says what it is indexed by, and a storage dtype and pad value:

    sample    one value per sample: a [B] tensor, or a list of B Python values (dtype None)
    sequence  a ragged 1-D token sequence per sample: B tensors [L_i] (`prompts`, `responses`)
    token     one value per response token: [B, T] right-padded with `pad`, T = longest response
    position  one value (or row) per sequence position, prompt + response: B tensors [P_i + R_i, ...]
    image     rows of the prompt's images: B tensors [N_i, ...] (patch rows, grid rows); a
              micro-batch concatenates its samples' rows, in row order (what the vision tower takes)

Selecting samples, joining batches, building a batch from per-sample values, splitting it over
DP ranks and packing micro-batches (`train/microbatch.py`) all iterate `FIELDS`, so a new field
(image grids, routed experts) is one row here plus the code that fills it. Each row also says who
writes it, which passes read it and where it lives between processes (data plane, the driver's
StepBatch metadata, or in-process batches only); the passes' column lists are derived from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch

SAMPLE, SEQUENCE, TOKEN, POSITION, IMAGE = "sample", "sequence", "token", "position", "image"
SCOPES = (SAMPLE, SEQUENCE, TOKEN, POSITION, IMAGE)


# Where a field lives between processes: a data-plane column (tokens: the engines write, ranks
# read their share), the driver's StepBatch metadata (a few numbers per response), or only in
# in-process batches (tools and checks).
PLANE, STEP, LOCAL = "plane", "step", "local"
# Who reads a plane field: the reward worker, the log-prob passes (actor old / ref), the update.
READ_BY_REWARD, READ_BY_LOGPROBS, READ_BY_UPDATE = "reward", "logprobs", "update"


@dataclass(frozen=True)
class Field:
    name: str
    scope: str  # one of SCOPES
    dtype: Optional[torch.dtype]  # storage dtype; None: a Python value per sample (scope sample only)
    pad: float = 0  # value of padded positions / rows
    doc: str = ""
    writer: str = "engine"  # engine | reward | actor | ref | manager | driver
    readers: tuple[str, ...] = ()  # READ_BY_*: the passes that read a plane field
    where: str = PLANE  # PLANE | STEP | LOCAL


_PASSES = (READ_BY_LOGPROBS, READ_BY_UPDATE)
FIELDS: dict[str, Field] = {f.name: f for f in [
    Field("prompts", SEQUENCE, torch.long, doc="prompt token ids as the engine saw them", readers=_PASSES),
    Field("responses", SEQUENCE, torch.long, doc="response token ids", readers=(READ_BY_REWARD, *_PASSES)),
    Field("loss_mask", TOKEN, torch.float32, doc="1 on response tokens the loss sees (default: all of them)",
          readers=_PASSES),
    Field("rollout_logprobs", TOKEN, torch.float32, doc="log p(token) from the engine", readers=_PASSES),
    Field("old_logprobs", TOKEN, torch.float32, doc="the actor's, recomputed before the update", writer="actor",
          readers=(READ_BY_UPDATE,)),
    Field("ref_logprobs", TOKEN, torch.float32, doc="the reference model's", writer="ref", readers=(READ_BY_UPDATE,)),
    Field("group", SAMPLE, torch.long, doc="the group (prompt) of the sample within the step", writer="manager",
          where=STEP),
    Field("prompt_index", SAMPLE, torch.long, doc="dataset index of the prompt", writer="manager", where=LOCAL),
    Field("scores", SAMPLE, torch.float32, doc="reward after shaping", writer="reward", where=STEP),
    Field("acc", SAMPLE, torch.bool, doc="answer correct", writer="reward", where=STEP),
    Field("advantages", SAMPLE, torch.float32, doc="GRPO advantage of the response (every token's)",
          writer="driver", where=STEP),
    Field("finish_reasons", SAMPLE, None, doc="stop | length | abort", where=LOCAL),
    Field("routed_experts", POSITION, torch.int16, pad=-1, readers=_PASSES,
          doc="[layers, top_k] expert ids per position (engine, or the actor's old-log-prob pass); -1: unknown"),
    # Vision-language prompts: what the engine's image processor made of the prompt's images. The
    # n responses of a prompt share one stored copy (dataplane: one image row per group).
    Field("pixel_values", IMAGE, torch.float32, doc="[N_patches, C*T*P*P] patch rows of the prompt's images",
          readers=_PASSES),
    Field("image_grid_thw", IMAGE, torch.long, doc="[N_images, 3] (t, h, w) patch grid of each image, in order",
          readers=_PASSES),
]}


def read_by(reader: str) -> tuple[str, ...]:
    """The plane fields `reader` (READ_BY_*) reads, in table order: computed at call time, so a
    row added to FIELDS reaches the passes with no other edit."""
    return tuple(name for name, f in FIELDS.items() if f.where == PLANE and reader in f.readers)


def step_fields() -> tuple[str, ...]:
    """The fields a StepBatch carries as metadata (the manager's, the reward's, the driver's)."""
    return tuple(name for name, f in FIELDS.items() if f.where == STEP)


@dataclass(frozen=True)
class Prompt:
    """What a prompt is on its way from the dataset to an engine: token ids (chat template applied)
    and, for vision-language models, its images: `data.images.ImageRef`s (the engine opens them)
    or PIL images."""
    ids: tuple[int, ...]
    images: tuple = ()

    def __len__(self) -> int:
        return len(self.ids)


def pad_right(rows: Sequence[torch.Tensor], value: float = 0.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Ragged tensors [L_i, ...] -> [B, L, ...] right-padded with `value` (L = the longest, at least 1)."""
    width = max((len(r) for r in rows), default=0) or 1
    trailing = tuple(rows[0].shape[1:]) if rows else ()
    out = torch.full((len(rows), width, *trailing), value,
                     dtype=dtype or (rows[0].dtype if rows else torch.float32))
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def unpad_positions(padded: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """[B, S, ...] right-padded position values -> a position column: B tensors [L_i, ...]."""
    return [padded[i, :n].clone() for i, n in enumerate(lengths)]


def _is_list(f: Field) -> bool:
    """Stored as a list of per-sample values rather than one tensor."""
    return f.scope in (SEQUENCE, POSITION, IMAGE) or f.dtype is None


class RolloutBatch:
    """B samples (responses), one column per `FIELDS` row; a column not computed yet is None.

    Columns read and write as attributes (`batch.old_logprobs = ...`); a name that is not in
    `FIELDS` is an error, so a typo cannot create a column nobody reads.
    """

    def __init__(self, **columns: Any):
        unknown = sorted(set(columns) - set(FIELDS))
        if unknown:
            raise KeyError(f"RolloutBatch has no field {unknown[0]!r}; the fields are dapo_megatron.batch.FIELDS")
        self.__dict__["columns"] = {name: columns.get(name) for name in FIELDS}
        if self.loss_mask is None and self.responses is not None:  # every response token counts
            self.loss_mask = pad_right([torch.ones(len(r)) for r in self.responses])

    def __getattr__(self, name: str):
        columns = self.__dict__.get("columns", {})
        if name in columns:
            return columns[name]
        raise AttributeError(f"RolloutBatch has no field {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name not in FIELDS:
            raise AttributeError(f"RolloutBatch has no field {name!r}; add a row to dapo_megatron.batch.FIELDS")
        self.columns[name] = value

    def __len__(self) -> int:
        return len(self.responses)

    @property
    def response_lengths(self) -> torch.Tensor:  # [B]
        return torch.tensor([len(r) for r in self.responses], dtype=torch.long)

    @property
    def sequence_lengths(self) -> list[int]:
        """prompt + response length of every sample (the length of its position fields)."""
        return [len(p) + len(r) for p, r in zip(self.prompts, self.responses)]

    @property
    def nbytes(self) -> int:
        """Bytes of the batch's tensors (what a Ray put of it moves, less Python values)."""
        total = 0
        for value in self.columns.values():
            for t in value if isinstance(value, list) else [value]:
                total += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        return total

    @classmethod
    def from_samples(cls, samples: Sequence[dict]) -> "RolloutBatch":
        """A batch from one dict per sample (field name -> that sample's value: a scalar for a
        sample field, a 1-D tensor or list for sequence / token fields, a tensor [P + R, ...] for
        position fields, [N, ...] for image fields). A field no sample has is None; one that only some have is an error."""
        columns = {}
        for name, f in FIELDS.items():
            have = [name in s for s in samples]
            if not any(have):
                continue
            if not all(have):
                raise ValueError(f"field {name!r} is set on {sum(have)} of {len(samples)} samples; set it on all")
            values = [s[name] for s in samples]
            if f.dtype is None:
                columns[name] = values
            elif f.scope == SAMPLE:
                columns[name] = torch.tensor(values, dtype=f.dtype)
            else:
                rows = [torch.as_tensor(v, dtype=f.dtype) for v in values]
                columns[name] = pad_right(rows, f.pad, f.dtype) if f.scope == TOKEN else rows
        return cls(**columns)

    def select(self, index: Sequence[int] | torch.Tensor) -> "RolloutBatch":
        """The samples at `index`, in that order (token columns keep their width)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        rows = idx.tolist()
        picked = {}
        for name, value in self.columns.items():
            if value is not None:
                picked[name] = [value[i] for i in rows] if _is_list(FIELDS[name]) else value[idx]
        return RolloutBatch(**picked)

    @staticmethod
    def concat(batches: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """Join batches; token columns are re-padded to the widest. A column missing from any
        batch is missing from the result."""
        if not batches:
            raise ValueError("RolloutBatch.concat needs at least one batch")
        out = {}
        for name, f in FIELDS.items():
            values = [b.columns[name] for b in batches]
            if any(v is None for v in values):
                continue
            if _is_list(f):
                out[name] = [x for v in values for x in v]
            elif f.scope == TOKEN:
                out[name] = pad_right([row for v in values for row in v], f.pad, f.dtype)
            else:
                out[name] = torch.cat(values)
        return RolloutBatch(**out)

    def present(self, scopes: Iterable[str]) -> list[Field]:
        """The fields of these scopes that this batch holds, in table order."""
        return [f for name, f in FIELDS.items() if f.scope in scopes and self.columns[name] is not None]
