"""Pure tensor reshapes between HF and Megatron layouts (no torch.distributed, no Megatron).

What the name tables cannot say lives here: the fused QKV interleaved per query group, gate/up
fused into linear_fc1, expert ids global <-> per EP rank, the vocab rows padded for TP, and the
experts that a file stacks into one tensor per layer (Qwen3-VL-MoE, `Arch.fused_experts`).
"""
from __future__ import annotations

import torch


def qkv_to_mcore(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int,
                 head_dim: int) -> torch.Tensor:
    """HF q/k/v -> Megatron linear_qkv, laid out `[groups, q_per_group + 2, head_dim, *rest]`.

    q: [heads*head_dim, *rest], k/v: [groups*head_dim, *rest] (weights: rest = [hidden]; biases: []).
    """
    rest = q.shape[1:]
    q = q.reshape(num_groups, -1, head_dim, *rest)  # [G, q_per_group, D, *rest]
    k = k.reshape(num_groups, 1, head_dim, *rest)
    v = v.reshape(num_groups, 1, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)  # [G*(q_per_group+2)*D, *rest]


def qkv_from_mcore(qkv: torch.Tensor, num_groups: int, head_dim: int):
    """Megatron linear_qkv -> (q, k, v) in HF layout; inverse of `qkv_to_mcore`."""
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_groups, -1, head_dim, *rest)  # [G, q_per_group+2, D, *rest]
    q_per_group = grouped.shape[1] - 2
    q, k, v = grouped.split([q_per_group, 1, 1], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def gate_up_to_mcore(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF gate_proj/up_proj [ffn, hidden] -> Megatron linear_fc1 [2*ffn, hidden] (gate first)."""
    return torch.cat([gate, up], dim=0)


def gate_up_from_mcore(fc1: torch.Tensor):
    """Megatron linear_fc1 [2*ffn, hidden] -> (gate, up); each TP shard holds its own halves."""
    gate, up = fc1.chunk(2, dim=0)
    return gate, up


def global_expert_id(local_id: int, ep_rank: int, experts_per_rank: int) -> int:
    return experts_per_rank * ep_rank + local_id


def local_expert_id(global_id: int, experts_per_rank: int) -> tuple[int, int]:
    """(ep_rank, local_id) of a global expert id."""
    return divmod(global_id, experts_per_rank)


def shard_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank's equal shard of `size` rows; `size` must divide evenly."""
    if size % world:
        raise ValueError(f"size {size} is not divisible by {world} ranks")
    step = size // world
    return rank * step, (rank + 1) * step


def pad_vocab(t: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Zero rows appended so the vocab dim (0) is `padded_rows` (Megatron pads it for TP)."""
    if t.shape[0] > padded_rows:
        raise ValueError(f"vocab rows {t.shape[0]} exceed the padded size {padded_rows}")
    if t.shape[0] == padded_rows:
        return t
    pad = t.new_zeros((padded_rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad], dim=0)


def trim_vocab(t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return t[:vocab_size]


# Layouts of a layer's experts stacked in one file tensor [E, ...]: "official" holds each
# expert's parts concatenated along their rows, then transposed (Qwen3-VL checkpoints, vLLM);
# "rows" untransposed (transformers 5.19's save_pretrained).
FUSED_LAYOUTS = ("official", "rows")


def fused_experts_layout(shape: tuple[int, ...], num_experts: int, rows: int, cols: int) -> str | None:
    """The layout of a fused expert tensor of `shape`, whose experts' parts concatenated are
    [rows, cols]; None when it is neither. A square [rows == cols] tensor reads as official,
    as vLLM reads every fused checkpoint tensor."""
    if tuple(shape) == (num_experts, cols, rows):
        return "official"
    if tuple(shape) == (num_experts, rows, cols):
        return "rows"
    return None


def expert_part(fused_expert: torch.Tensor, layout: str, num_parts: int, part: int) -> torch.Tensor:
    """One expert's slice of a fused tensor ([cols, rows] official, [rows, cols] else) -> its
    part-th HF tensor (gate_proj, up_proj of gate_up_proj; down_proj) [rows / num_parts, cols], a view."""
    rows_first = fused_expert.t() if layout == "official" else fused_expert
    return rows_first.chunk(num_parts, dim=0)[part]


def stack_experts(parts: list[torch.Tensor], num_parts: int) -> torch.Tensor:
    """Per-expert HF tensors, expert by expert and part by part ([gate_0, up_0, gate_1, ...]) ->
    the fused tensor in the official layout [E, cols, rows]; inverse of `expert_part`."""
    experts = [torch.cat(parts[i:i + num_parts], dim=0).t() for i in range(0, len(parts), num_parts)]
    return torch.stack(experts)
