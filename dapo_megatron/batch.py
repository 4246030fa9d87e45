"""RolloutBatch: the one record that flows generate -> score -> filter -> log-probs -> update.

Token sequences are ragged (each prompt and response has its own length), so they are kept as
lists of 1-D tensors; per-token training quantities are right-padded `[B, T]` tensors over the
response positions (T = the longest response), with `loss_mask` marking real tokens. Between
processes the driver passes Ray references to batches, never their contents.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

# Fields indexed per sample (list or leading dim B); everything else in the batch is per-batch.
_PER_TOKEN = ("loss_mask", "rollout_logprobs", "old_logprobs", "ref_logprobs", "advantages")
_PER_SAMPLE = ("scores", "acc", "group", "prompt_index")


def pad_right(rows: Sequence[torch.Tensor], value: float = 0.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Ragged 1-D tensors -> [B, T] right-padded with `value` (T = the longest row, at least 1)."""
    width = max((len(r) for r in rows), default=0) or 1
    out = torch.full((len(rows), width), value, dtype=dtype or (rows[0].dtype if rows else torch.float32))
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


@dataclass
class RolloutBatch:
    prompts: list[torch.Tensor]  # B x [P_i] prompt token ids
    responses: list[torch.Tensor]  # B x [R_i] response token ids
    group: torch.Tensor  # [B] long: index of the prompt (group of n responses) within the step
    prompt_index: torch.Tensor  # [B] long: dataset index of the prompt (for resume and logging)
    rollout_logprobs: Optional[torch.Tensor] = None  # [B, T] from the engine
    finish_reasons: list[str] = field(default_factory=list)  # B: "stop" | "length" | "abort"
    ground_truths: list[str] = field(default_factory=list)  # B
    data_sources: list[str] = field(default_factory=list)  # B
    scores: Optional[torch.Tensor] = None  # [B] reward after shaping
    acc: Optional[torch.Tensor] = None  # [B] bool
    old_logprobs: Optional[torch.Tensor] = None  # [B, T] actor before the update
    ref_logprobs: Optional[torch.Tensor] = None  # [B, T] reference model
    advantages: Optional[torch.Tensor] = None  # [B, T] (GRPO: the sequence advantage on every token)

    def __len__(self) -> int:
        return len(self.responses)

    @property
    def response_lengths(self) -> torch.Tensor:  # [B]
        return torch.tensor([len(r) for r in self.responses], dtype=torch.long)

    @property
    def loss_mask(self) -> torch.Tensor:  # [B, T] float, 1 on real response tokens
        lengths = self.response_lengths
        width = max(int(lengths.max()) if len(lengths) else 0, 1)
        return (torch.arange(width)[None, :] < lengths[:, None]).float()

    @property
    def nbytes(self) -> int:
        """Bytes of the batch's tensors (what a Ray put of it moves, less the small string fields)."""
        total = 0
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            for t in value if isinstance(value, list) else [value]:
                total += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        return total

    def select(self, index: Sequence[int] | torch.Tensor) -> "RolloutBatch":
        """The samples at `index`, in that order (per-token tensors keep their width)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        picked = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or (isinstance(value, list) and not value):
                picked[f.name] = value
            elif isinstance(value, list):
                picked[f.name] = [value[i] for i in idx.tolist()]
            else:
                picked[f.name] = value[idx]
        return RolloutBatch(**picked)

    @staticmethod
    def concat(batches: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """Join batches; per-token tensors are re-padded to the widest."""
        if not batches:
            raise ValueError("RolloutBatch.concat needs at least one batch")
        out = {}
        for f in dataclasses.fields(RolloutBatch):
            values = [getattr(b, f.name) for b in batches]
            if any(v is None for v in values):
                out[f.name] = None
            elif isinstance(values[0], list):
                out[f.name] = [x for v in values for x in v]
            elif f.name in _PER_TOKEN:
                out[f.name] = pad_right([row for v in values for row in v], dtype=values[0].dtype)
            else:
                out[f.name] = torch.cat(values)
        return RolloutBatch(**out)
