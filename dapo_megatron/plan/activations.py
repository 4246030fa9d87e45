"""Activation memory of one training micro-batch on one rank, from the model's shape.

Counted as the tensors autograd keeps per token of a decoder layer (Megatron's local spec: the
norms', linears' and attention's inputs and outputs), times the tokens of the largest
micro-batch, the layers a rank holds and the micro-batches in flight under 1F1B (the first
stage holds `pp` of them). Kernel-dependent terms follow the device's attention kernel: a flash
kernel keeps q, k, v, its output and a log-sum-exp; the unfused path (CPU) also keeps the
softmax probabilities, heads x sequence length per token. Under sequence parallelism the
tensors outside attention and the MLP are split over TP.
"""
from __future__ import annotations

from dataclasses import dataclass

from dapo_megatron.models.gpt import padded_vocab_size


@dataclass(frozen=True)
class Shape:
    """What the formulas read: the model's sizes at a parallel layout, and the micro-batch."""
    hidden: int
    heads: int  # per TP rank
    kv_heads: int  # per TP rank (>= 1: replicated when fewer than TP)
    head_dim: int
    ffn: int  # dense MLP, per TP rank (0 for MoE)
    moe_ffn: int  # per expert-TP rank (0 for dense)
    experts: int
    top_k: int
    vocab: int  # padded vocabulary per TP rank
    qk_norm: bool
    tp: int
    etp: int
    sp: bool  # sequence parallel
    dtype_bytes: int


def shape_of(spec, par, *, dtype_bytes: int) -> Shape:
    tp, etp = par.tp, par.etp
    sp = tp > 1 and (par.sequence_parallel or spec.is_moe)  # models/gpt.py forces SP for MoE at TP > 1
    return Shape(hidden=spec.hidden_size, heads=spec.num_heads // tp, kv_heads=max(spec.num_kv_heads // tp, 1),
                 head_dim=spec.head_dim, ffn=0 if spec.is_moe else spec.ffn_hidden_size // tp,
                 moe_ffn=spec.moe_ffn_hidden_size // etp if spec.is_moe else 0, experts=spec.num_experts,
                 top_k=spec.moe_top_k, vocab=padded_vocab_size(spec.vocab_size, tp) // tp,
                 qk_norm=spec.arch.qk_layernorm, tp=tp, etp=etp, sp=sp, dtype_bytes=dtype_bytes)


def layer_bytes_per_token(s: Shape, seq_len: int, *, flash: bool, recompute: str) -> float:
    """Bytes one decoder layer keeps for backward per token of the micro-batch (per TP rank).

    recompute "": everything below; "selective": the attention core's internals are recomputed
    (its inputs stay); "full": the layer's input only (the layer is rerun in backward).
    """
    b = s.dtype_bytes
    local = s.hidden / s.tp if s.sp else s.hidden  # a token's hidden state outside TP regions
    if recompute == "full":
        return local * b
    d, a, g = s.head_dim, s.heads, s.kv_heads
    qk = (a + g) * d
    attention = (2 * local  # the input norm's input and the qkv projection's (SP: its local shard)
                 + (a + 2 * g) * d  # q, k, v (the projection's output)
                 + (qk if s.qk_norm else 0)  # q, k after their norms
                 + qk  # q, k after RoPE: the attention's inputs with v
                 + a * d) * b  # the attention's output, the output projection's input
    if not flash and recompute != "selective":
        attention += a * seq_len * (4 + (b if b < 4 else 0))  # softmax probs (fp32, and cast back)
    if s.experts:
        # Each token visits top_k experts; the all-gather dispatcher gathers the SP shards of the
        # expert-TP x EP group, so a rank computes (tokens / TP) x ETP x top_k expert rows.
        rows = s.top_k * s.etp / s.tp if s.sp else s.top_k
        mlp = (2 * local) * b + 8 * s.experts * (1 / s.tp if s.sp else 1)  # norm, router in; fp32 logits, probs
        mlp += rows * (2 * s.hidden + 4 * s.moe_ffn) * b  # expert in / weighted out, fc1 out, SiLU, GLU
    else:
        mlp = (2 * local + 4 * s.ffn) * b  # norm, fc1 in; fc1 out (gate, up), SiLU(gate), GLU out
    return attention + mlp


def logits_bytes(s: Shape, tokens: int, *, backward: bool, entropy_grad: bool) -> float:
    """The last stage's vocabulary-sized tensors for `tokens` tokens (train/logprobs.py): the
    logits in the compute dtype, their fp32 copy and its masked copy (padding rows), which
    Megatron's cross entropy turns into the softmax in place; backward adds the fp32 gradient.
    The entropy bonus with a gradient keeps exp(logits) and its product with the logits too."""
    per_token = s.vocab * (s.dtype_bytes + 2 * 4 + (4 if backward else 0) + (2 * 4 if entropy_grad else 0))
    return tokens * per_token


def training_bytes(s: Shape, *, layers: int, in_flight: int, tokens: int, seq_len: int, flash: bool,
                   recompute: str, last_stage: bool, entropy_grad: bool) -> dict[str, float]:
    """{term: bytes} of one rank's update: the layers' saved activations for `in_flight`
    micro-batches (plus one layer's recomputation under full recompute) and, on the last
    stage, the logits of one micro-batch."""
    per_layer = layer_bytes_per_token(s, seq_len, flash=flash, recompute=recompute)
    out = {"activations": per_layer * tokens * layers * in_flight}
    if recompute == "full":  # the layer being recomputed holds its full set meanwhile
        out["activations"] += layer_bytes_per_token(s, seq_len, flash=flash, recompute="") * tokens
    if last_stage:
        out["logits"] = logits_bytes(s, tokens, backward=True, entropy_grad=entropy_grad)
    return out
