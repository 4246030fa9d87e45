"""Dynamic batch size: split a RolloutBatch over DP ranks, then into micro-batches by a token budget.

Sequences are prompt + response, right-padded inside a micro-batch only (causal attention never
looks at the padding to its right). Micro-batch tensors are laid out for the trainer:

    tokens        [b, S]  prompt + response ids, S a multiple of `seq_multiple` (TP, for SP)
    labels        [b, S]  tokens shifted left (labels[:, t] = tokens[:, t + 1])
    then every field the batch holds, by its scope in `batch.FIELDS`:
    sample        [b]     (padding rows hold the field's pad value)
    token         [b, T]  response-aligned, T = the batch's response width (same in every
                          micro-batch, so seq-mean-token-sum-norm divides by one constant)
    position      [b, S, ...] aligned with `tokens`
    image         [N, ...] the real rows' image rows concatenated in row order (absent without images)
How a micro-batch becomes model inputs is the model's business (`models.Arch.inputs_fn`).

Every function here is a pure function of the batch, so every rank of a pipeline / TP group
computes the same plan without communication; only `harmonize` talks to other ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from dapo_megatron.batch import FIELDS, IMAGE, POSITION, SAMPLE, TOKEN, RolloutBatch


def split_for_dp(lengths: list[int], dp: int) -> list[list[int]]:
    """Balanced, deterministic split of sample indices over `dp` ranks (longest first to the
    least-loaded rank); each rank's list is sorted so results keep the input order."""
    loads, shares = [0] * dp, [[] for _ in range(dp)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(dp), key=lambda r: (loads[r], len(shares[r]), r))
        loads[rank] += lengths[i]
        shares[rank].append(i)
    return [sorted(s) for s in shares]


def minibatch_shares(sequence_lengths: list[int], loss_tokens: list[int], mini_size: int, dp: int,
                     dp_rank: int) -> list[tuple[list[int], tuple[int, int]]]:
    """Per mini-batch of `mini_size` consecutive samples: (the samples DP rank `dp_rank` trains
    on, the mini-batch's (loss tokens, samples) over all ranks: the loss's global normalisers)."""
    out = []
    for start in range(0, len(sequence_lengths), mini_size):
        rows = list(range(start, min(start + mini_size, len(sequence_lengths))))
        share = split_for_dp([sequence_lengths[i] for i in rows], dp)[dp_rank]
        out.append(([rows[i] for i in share], (sum(loss_tokens[i] for i in rows), len(rows))))
    return out


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def token_bins(lengths: list[int], max_tokens: int, seq_multiple: int = 1) -> list[list[int]]:
    """Group indices into micro-batches whose padded size rows * padded_len <= max_tokens.

    Sorted longest first, so a bin's first sequence sets its padded length; a sequence longer
    than the budget gets a bin of its own. Returns positions into `lengths`.
    """
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if bins and (len(bins[-1]) + 1) * round_up(lengths[bins[-1][0]], seq_multiple) <= max_tokens:
            bins[-1].append(i)
        else:
            bins.append([i])
    return bins


@dataclass
class MicroBatch:
    index: list[int]  # row -> sample index in the full batch; -1 for a padding row
    tokens: torch.Tensor  # [b, S] long
    labels: torch.Tensor  # [b, S] long
    prompt_lens: torch.Tensor  # [b] long
    fields: dict = field(default_factory=dict)  # batch field name -> [b], [b, T], [b, S, ...] or [N, ...]
    response_lens: Optional[torch.Tensor] = None  # [b] long

    def __getattr__(self, name: str):
        """A batch field by name (`micro.old_logprobs`); None when the batch did not hold it."""
        fields = self.__dict__.get("fields", {})
        if name in fields or name in FIELDS:
            return fields.get(name)
        raise AttributeError(f"MicroBatch has no field {name!r}")

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) prompt + response tokens (tool tokens of multi-turn responses too,
        which are out of loss_mask): the rows' non-pad positions."""
        return int(self.prompt_lens.sum()) + int(self.response_lens.sum())


def build_microbatch(batch: RolloutBatch, index: list[int], rows: int, seq_len: int,
                     width: int) -> MicroBatch:
    """Pack samples `index` into [rows, seq_len] (extra rows are padding); every tensor field of
    the batch goes along, laid out by its scope."""
    tokens = torch.zeros(rows, seq_len, dtype=torch.long)  # [b, S]
    prompt_lens = torch.zeros(rows, dtype=torch.long)  # [b]
    response_lens = torch.zeros(rows, dtype=torch.long)  # [b]
    for row, i in enumerate(index):
        p, r = batch.prompts[i], batch.responses[i]
        tokens[row, : len(p)] = p
        tokens[row, len(p): len(p) + len(r)] = r
        prompt_lens[row], response_lens[row] = len(p), len(r)
    labels = torch.roll(tokens, -1, dims=1)  # [b, S]; the wrapped last column is never used
    fields = {}
    for f in batch.present((SAMPLE, TOKEN, POSITION, IMAGE)):
        if f.dtype is None:
            continue  # Python values (finish reasons): nothing for the model
        src = batch.columns[f.name]
        if f.scope == IMAGE:  # each row's images, row after row: the order of their image tokens
            parts = [src[i] for i in index if len(src[i])]
            if parts:
                fields[f.name] = torch.cat(parts)
            continue
        if f.scope == SAMPLE:
            out = torch.full((rows,), f.pad, dtype=f.dtype)  # [b]
            out[: len(index)] = src[index]
        elif f.scope == TOKEN:
            out = torch.full((rows, width), f.pad, dtype=f.dtype)  # [b, T]
            n = min(src.shape[1], width)
            out[: len(index), :n] = src[index, :n]
        else:
            out = torch.full((rows, seq_len, *src[0].shape[1:]), f.pad, dtype=f.dtype)  # [b, S, ...]
            for row, i in enumerate(index):
                out[row, : len(src[i])] = src[i]
        fields[f.name] = out
    return MicroBatch(index + [-1] * (rows - len(index)), tokens, labels, prompt_lens, fields, response_lens)


@dataclass(frozen=True)
class Plan:
    """This DP rank's micro-batches: sample indices and their padded shapes (rows, seq_len)."""
    bins: list[list[int]]
    shapes: list[tuple[int, int]]


def plan_microbatches(batch: RolloutBatch, share: list[int], max_tokens: int, seq_multiple: int) -> Plan:
    """Token-budget bins of the samples in `share` (indices into the full batch)."""
    lengths = batch.sequence_lengths
    local = [lengths[i] for i in share]
    bins = [[share[j] for j in b] for b in token_bins(local, max_tokens, seq_multiple)]
    shapes = [(len(b), round_up(max(lengths[i] for i in b), seq_multiple)) for b in bins]
    return Plan(bins, shapes)


def harmonize(plan: Plan, group, *, min_count: int = 0, count_multiple: int = 1,
              seq_multiple: int = 1) -> Plan:
    """Give every rank of `group` the same number of micro-batches and the same shape per
    micro-batch (MAX over the group; padding rows/micro-batches carry no loss).

    Needed when ranks of different DP shares meet inside the forward (EP token dispatch is a
    collective over ranks that hold different data) and for the interleaved schedule, which
    needs a micro-batch count >= PP. `group=None` skips the communication.
    """
    import torch.distributed as dist
    count = max(len(plan.bins), min_count)
    if group is not None:
        n = torch.tensor([count])
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
        count = int(n)
    count = round_up(max(count, 1), count_multiple)
    shapes = torch.ones(count, 2, dtype=torch.long) * torch.tensor([1, seq_multiple])  # [M, 2]
    if plan.shapes:
        shapes[: len(plan.shapes)] = torch.maximum(shapes[: len(plan.shapes)], torch.tensor(plan.shapes))
    if group is not None:
        dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=group)
    bins = plan.bins + [[] for _ in range(count - len(plan.bins))]
    return Plan(bins, [tuple(s) for s in shapes.tolist()])


def materialize(batch: RolloutBatch, plan: Plan, width: Optional[int] = None) -> list[MicroBatch]:
    width = width or batch.loss_mask.shape[1]  # T: the whole batch's, so every micro-batch agrees
    return [build_microbatch(batch, b, rows, seq, width) for b, (rows, seq) in zip(plan.bins, plan.shapes)]
