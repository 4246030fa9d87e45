"""Per-token log-probs and entropy from vocab-parallel logits, and the Megatron schedule driver.

Logits stay split over TP ranks ([b, S, V/TP]); log-probs come from Megatron's
`vocab_parallel_cross_entropy` and entropy from three TP all-reduces (max, sum exp, sum p*l), so
no rank ever holds the full vocabulary. Rows of the vocabulary added by padding
(`padded_vocab_size`) are masked out: Megatron-LM keeps them in the softmax, HF has no such rows.

`forward_backward` runs Megatron's own schedule (`get_forward_backward_func`: no pipelining,
1F1B, or interleaved VPP) over a list of MicroBatch, feeding and calling the model as its
`Arch` row says; `compute_logprobs` uses it forward-only. Each DP rank's last pipeline stage
(TP / CP rank 0) returns the `Rows` it computed and nobody else returns anything: the caller
joins them with `assemble`, so no rank gathers a [B, T] result it does not need.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from dapo_megatron.batch import RolloutBatch
from dapo_megatron.parallel import coords, group
from dapo_megatron.train import microbatch as mb
from dapo_megatron.train import routing
from dapo_megatron.weights.load import unwrap


def _vocab_mask(logits: torch.Tensor, vocab_size: int) -> Optional[torch.Tensor]:
    """[V/TP] bool, True on this rank's padding rows of the vocabulary; None when there are none."""
    part = logits.shape[-1]
    start = part * coords().tp_rank
    if start + part <= vocab_size:
        return None
    return torch.arange(start, start + part, device=logits.device) >= vocab_size


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax over the TP-split last dim: log Z - E_p[l]. [..., V/TP] -> [...].

    The max is a detached shift (the value does not depend on it); the two sums go through
    `reduce_from_tensor_model_parallel_region`, whose backward is the identity, so the gradient
    of each rank's slice is exact. Logits of masked rows must be very negative but finite.
    """
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region as tp_sum
    logits = logits.float()
    shift = logits.detach().max(dim=-1, keepdim=True)[0]  # [..., 1]
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group("tp"))
    exp = torch.exp(logits - shift)  # [..., V/TP]
    sum_exp = tp_sum(exp.sum(dim=-1))  # [...]
    sum_exp_l = tp_sum((exp * (logits - shift)).sum(dim=-1))  # [...]
    return torch.log(sum_exp) - sum_exp_l / sum_exp


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, *,
                   temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = True):
    """(log p(labels) [b, S], entropy [b, S] or None) from vocab-parallel logits [b, S, V/TP].

    `entropy_grad=False` computes the entropy as a detached metric (no saved activations).
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    pad = _vocab_mask(logits, vocab_size)
    if pad is not None:
        logits = logits.masked_fill(pad, torch.finfo(logits.dtype).min)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = vocab_parallel_entropy(logits if entropy_grad else logits.detach())
    # vocab_parallel_cross_entropy subtracts the max in place: give it its own copy when the
    # entropy's autograd graph still needs the logits.
    keep = with_entropy and entropy is not None and entropy.requires_grad
    logprobs = -vocab_parallel_cross_entropy(logits.clone() if keep else logits, labels)
    return logprobs, entropy


def response_aligned(per_pos: torch.Tensor, micro: mb.MicroBatch) -> torch.Tensor:
    """Per-position values [b, S] (position t scores token t + 1) -> response tokens [b, T]."""
    width = micro.loss_mask.shape[1]
    start = (micro.prompt_lens - 1).clamp(min=0)  # [b]; response token j is scored at P - 1 + j
    cols = (start[:, None] + torch.arange(width)[None, :]).clamp(max=per_pos.shape[1] - 1)  # [b, T]
    return torch.gather(per_pos, 1, cols.to(per_pos.device)) * micro.loss_mask.to(per_pos.device)


def forward_backward(chunks: list, arch, micros: list[mb.MicroBatch], loss_fn: Callable, *,
                     forward_only: bool) -> list:
    """Run Megatron's schedule over `micros`; `loss_fn(micro, output) -> (loss, n_tokens, data)`.

    `arch` (the model's `Arch` row) turns a micro-batch into model inputs and calls the model.
    Returns the `data` of every micro-batch, in order, on the last pipeline stage ([] elsewhere).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        micro = next(data_iterator)
        routing.feed(model, micro)  # this micro-batch's routes, when the chunk replays them
        inputs = arch.inputs_fn(micro, next(model.parameters()).device, unwrap(model).spec)
        # [b, S, V/TP] on the last stage, hidden states elsewhere
        return arch.forward_fn(model, inputs), partial(loss_fn, micro)

    seq_len = max(m.tokens.shape[1] for m in micros)
    iterators = [iter(micros) for _ in chunks]  # one per virtual stage, same micro-batches
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(micros),
        seq_length=seq_len, micro_batch_size=micros[0].tokens.shape[0], forward_only=forward_only)


def plan_for_rank(batch: RolloutBatch, max_tokens: int, local: bool = False) -> mb.Plan:
    """This rank's harmonised micro-batch plan: over its DP share of `batch`, or over all of
    `batch` when it holds only this rank's rows (`local`: read from the data plane)."""
    c = coords()
    share = list(range(len(batch))) if local else mb.split_for_dp(batch.sequence_lengths, c.dp)[c.dp_rank]
    plan = mb.plan_microbatches(batch, share, max_tokens, c.tp)
    # EP dispatch is a collective across DP shares: same count and shapes on all DP ranks.
    dp_group = group("dp") if c.ep > 1 else None
    # The interleaved schedule needs M >= PP and M % PP in {0, >= PP}: pad to a multiple of PP.
    interleaved = c.vpp > 1
    return mb.harmonize(plan, dp_group, min_count=c.pp if interleaved else 0,
                                count_multiple=c.pp if interleaved else 1, seq_multiple=c.tp)


@dataclass
class Rows:
    """Rows of per-token results one rank computed: which samples, and their values."""
    index: list[int]  # sample indices into the batch
    values: dict[str, torch.Tensor]  # name -> [len(index), T, ...]
    size: int  # B, the batch's sample count
    metrics: dict = field(default_factory=dict)  # the same on every reporting rank


def assemble(parts: Iterable[Optional[Rows]]) -> dict[str, torch.Tensor]:
    """Every reporting rank's Rows -> full [B, T] tensors; every sample must come exactly once."""
    parts = [p for p in parts if p is not None]
    if not parts:
        raise ValueError("no rank reported any rows")
    size = parts[0].size
    index = [i for p in parts for i in p.index]
    if sorted(index) != list(range(size)):
        raise RuntimeError(f"ranks reported {len(index)} rows for a batch of {size}, not each sample once")
    order = torch.tensor(index)
    return {name: torch.empty(size, *parts[0].values[name].shape[1:], dtype=parts[0].values[name].dtype)
            .index_copy_(0, order, torch.cat([p.values[name] for p in parts]))
            for name in parts[0].values}


def compute_logprobs(chunks: list, arch, batch: RolloutBatch, *, max_tokens: int, vocab_size: int,
                     temperature: float = 1.0, with_entropy: bool = False,
                     routes: Optional[routing.Routes] = None, local: bool = False) -> Optional[Rows]:
    """Log-probs (and entropy, `with_entropy`) [n, T] of the response tokens of this DP rank's
    share, 0 on padding positions, as Rows on the rank that reports them (last pipeline stage,
    TP / CP rank 0; with `local` every TP rank there, which holds the same values and keeps them
    for its update); None elsewhere. A collective over the whole world.

    `routes` (MoE actors with routing replay): replay `batch.routed_experts` when it has them,
    measure how often the router agrees with them (Rows.metrics), or record the router's choices
    (Rows.values["routed_experts"], [n, S, layers, k] with S the batch's longest sequence).
    `local`: `batch` holds only this DP rank's rows (see `plan_for_rank`).
    """
    plan = plan_for_rank(batch, max_tokens, local)
    micros = mb.materialize(batch, plan)

    def loss_fn(micro, output):
        lp, ent = token_logprobs(output, micro.labels, vocab_size, temperature=temperature,
                                 with_entropy=with_entropy)
        data = {"logprobs": response_aligned(lp, micro)}
        if with_entropy:
            data["entropy"] = response_aligned(ent, micro)
        return output.new_zeros(()), torch.tensor(0, dtype=torch.int), data

    for chunk in chunks:
        chunk.eval()
    recorded, metrics = None, {}
    with torch.no_grad(), routing.routing_mode(routes, update=False):
        results = forward_backward(chunks, arch, micros, loss_fn, forward_only=True)
        if routes is not None:
            agree = routing.agreement(routes.flat)
            if agree is not None:
                metrics["rollout/router_agreement"] = agree
            if routes.record:
                recorded = routing.gather_recorded(routes.flat, micros, routes.num_layers, routes.top_k,
                                                   max(batch.sequence_lengths))
    c = coords()
    if not results or c.cp_rank or (c.tp_rank and not local):
        return None
    index, values = [], {name: [] for name in results[0]}
    if recorded is not None:
        values["routed_experts"] = []
    for m, (micro, data) in enumerate(zip(micros, results)):
        rows = [r for r, i in enumerate(micro.index) if i >= 0]
        index += [micro.index[r] for r in rows]
        for name, t in data.items():
            values[name].append(t[rows].float().cpu())
        if recorded is not None:
            values["routed_experts"].append(recorded[m][rows])
    return Rows(index, {name: torch.cat(v) for name, v in values.items()}, len(batch), metrics)
