"""Per-token log-probs and entropy from vocab-parallel logits, and the Megatron schedule driver.

Logits stay split over TP ranks ([b, S, V/TP]); log-probs come from Megatron's
`vocab_parallel_cross_entropy` and entropy from three TP all-reduces (max, sum exp, sum p*l), so
no rank ever holds the full vocabulary. Rows of the vocabulary added by padding
(`padded_vocab_size`) are masked out: Megatron-LM keeps them in the softmax, HF has no such rows.

`forward_backward` runs Megatron's own schedule (`get_forward_backward_func`: no pipelining,
1F1B, or interleaved VPP) over a list of MicroBatch; `compute_logprobs` uses it forward-only and
returns the full [B, T] result on every rank.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from dapo_megatron.batch import RolloutBatch
from dapo_megatron.train import microbatch as mb


def _vocab_mask(logits: torch.Tensor, vocab_size: int) -> Optional[torch.Tensor]:
    """[V/TP] bool, True on this rank's padding rows of the vocabulary; None when there are none."""
    from megatron.core import parallel_state as mpu
    part = logits.shape[-1]
    start = part * mpu.get_tensor_model_parallel_rank()
    if start + part <= vocab_size:
        return None
    return torch.arange(start, start + part, device=logits.device) >= vocab_size


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax over the TP-split last dim: log Z - E_p[l]. [..., V/TP] -> [...].

    The max is a detached shift (the value does not depend on it); the two sums go through
    `reduce_from_tensor_model_parallel_region`, whose backward is the identity, so the gradient
    of each rank's slice is exact. Logits of masked rows must be very negative but finite.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region as tp_sum
    logits = logits.float()
    shift = logits.detach().max(dim=-1, keepdim=True)[0]  # [..., 1]
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
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


def forward_backward(chunks: list, micros: list[mb.MicroBatch], loss_fn: Callable, *,
                     forward_only: bool) -> list:
    """Run Megatron's schedule over `micros`; `loss_fn(micro, output) -> (loss, n_tokens, data)`.

    Returns the `data` of every micro-batch, in order, on the last pipeline stage ([] elsewhere).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        micro = next(data_iterator)
        dev = next(model.parameters()).device
        # [b, S, V/TP] on the last stage, hidden states elsewhere
        output = model(micro.tokens.to(dev), micro.position_ids.to(dev), None)
        return output, partial(loss_fn, micro)

    seq_len = max(m.tokens.shape[1] for m in micros)
    iterators = [iter(micros) for _ in chunks]  # one per virtual stage, same micro-batches
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(micros),
        seq_length=seq_len, micro_batch_size=micros[0].tokens.shape[0], forward_only=forward_only)


def plan_for_rank(batch: RolloutBatch, max_tokens: int) -> tuple[list[list[int]], mb.Plan]:
    """(every DP rank's share, this rank's harmonised micro-batch plan)."""
    from megatron.core import parallel_state as mpu
    dp, tp = mpu.get_data_parallel_world_size(), mpu.get_tensor_model_parallel_world_size()
    pp = mpu.get_pipeline_model_parallel_world_size()
    vpp = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
    shares = mb.split_for_dp(mb.sequence_lengths(batch), dp)
    plan = mb.plan_microbatches(batch, shares[mpu.get_data_parallel_rank()], max_tokens, tp)
    # EP dispatch is a collective across DP shares: same count and shapes on all DP ranks.
    group = mpu.get_data_parallel_group() if mpu.get_expert_model_parallel_world_size() > 1 else None
    # The interleaved schedule needs M >= PP and M % PP in {0, >= PP}: pad to a multiple of PP.
    return shares, mb.harmonize(plan, group, min_count=pp if vpp > 1 else 0,
                                count_multiple=pp if vpp > 1 else 1, seq_multiple=tp)


def gather_rows(local: dict, shape: tuple[int, int], names: list[str], device=None) -> dict:
    """Rows filled by each DP rank on the last stage -> full [B, T] tensors on every rank.

    `local[name]` is a [B, T] tensor holding this DP rank's rows (zeros elsewhere; zeros on
    non-last pipeline stages): a SUM over DP fills every row once, then the last pipeline stage
    broadcasts to the others.
    """
    from megatron.core import parallel_state as mpu
    out = {}
    for name in names:
        t = local[name].to(device) if name in local else torch.zeros(shape, device=device)
        dist.all_reduce(t, group=mpu.get_data_parallel_group())
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(t, src=mpu.get_pipeline_model_parallel_last_rank(),
                           group=mpu.get_pipeline_model_parallel_group())
        out[name] = t.cpu()
    return out


def compute_logprobs(chunks: list, batch: RolloutBatch, *, max_tokens: int, vocab_size: int,
                     temperature: float = 1.0, with_entropy: bool = False) -> dict:
    """{"logprobs": [B, T], "entropy": [B, T] (with_entropy)} of the response tokens, on every
    rank, in the input order; 0 on padding positions. Collective over the whole world."""
    _, plan = plan_for_rank(batch, max_tokens)
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
    with torch.no_grad():
        results = forward_backward(chunks, micros, loss_fn, forward_only=True)
    shape = tuple(batch.loss_mask.shape)
    names = ["logprobs"] + (["entropy"] if with_entropy else [])
    local = {}
    if results:
        local = {name: torch.zeros(shape) for name in names}
        for micro, data in zip(micros, results):
            rows = [r for r, i in enumerate(micro.index) if i >= 0]
            for name in names:
                local[name][[micro.index[r] for r in rows]] = data[name][rows].float().cpu()
    return gather_rows(local, shape, names, device=next(chunks[0].parameters()).device)
