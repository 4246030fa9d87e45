"""ModelSpec of a decoder-only LM -> Megatron-Core `TransformerConfig`, layer spec, `GPTModel`
chunks, and how a micro-batch is fed to them.

Covers Qwen2/2.5 (qkv bias), Qwen3 (qk-norm, explicit head_dim) and Qwen3-MoE (top-k router,
norm_topk_prob, no shared expert). Parallel degrees come from the layout interface,
`dapo_megatron.parallel.coords()`: set once, by `train.parallel.init_parallel`, and validated at
the entry point.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dapo_megatron.dtypes import DTYPES
from dapo_megatron.parallel import coords


def _moe_kwargs(spec) -> dict:
    # Megatron: pre_softmax=False is top-k on logits then softmax over the k, i.e. the
    # renormalised probabilities of norm_topk_prob=True; pre_softmax=True keeps raw softmax probs.
    return dict(num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_top_k,
                moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
                moe_router_pre_softmax=not spec.norm_topk_prob, moe_router_score_function="softmax",
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_router_dtype="fp32", moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
                moe_shared_expert_intermediate_size=None)


def gpt_config_kwargs(spec, arch) -> dict:
    """TransformerConfig kwargs that follow from the model spec (no parallel degrees, no dtype)."""
    kw = dict(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
              num_attention_heads=spec.num_heads, num_query_groups=spec.num_kv_heads,
              kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size, normalization="RMSNorm",
              layernorm_epsilon=spec.rms_norm_eps, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
              qk_layernorm=arch.qk_layernorm, gated_linear_unit=True, activation_func=F.silu,
              hidden_dropout=0.0, attention_dropout=0.0,
              # Fusions are CUDA kernels; the unfused paths are exact and run everywhere.
              bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
              apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
    if arch.moe:
        kw.update(_moe_kwargs(spec))
    return kw


def transformer_config(spec, arch, *, dtype: str = "fp32", sequence_parallel: bool = False,
                       use_cpu_initialization: bool = False, **overrides):
    """The Megatron TransformerConfig for `spec` at the current parallel layout."""
    from megatron.core.transformer import TransformerConfig
    c = coords()
    assert spec.num_layers % (c.pp * c.vpp) == 0 and (not arch.moe or spec.num_experts % c.ep == 0), \
        "layers / experts do not split over the layout (config/validate.py:check_model checks this)"
    params_dtype = DTYPES[dtype].torch
    kw = arch.config_fn(spec, arch)
    kw.update(tensor_model_parallel_size=c.tp, pipeline_model_parallel_size=c.pp,
              virtual_pipeline_model_parallel_size=c.vpp if c.vpp > 1 else None, context_parallel_size=c.cp,
              expert_model_parallel_size=c.ep, expert_tensor_parallel_size=c.etp,
              # Megatron refuses MoE with TP but without SP (tokens are split over TP for routing).
              sequence_parallel=c.tp > 1 and (sequence_parallel or arch.moe),
              params_dtype=params_dtype, pipeline_dtype=params_dtype,
              bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
              use_cpu_initialization=use_cpu_initialization, batch_p2p_sync=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
        return True
    except ImportError:
        return False


def layer_spec(tf_config, arch, use_te: bool):
    """Transformer Engine layer spec when available, Megatron's local (torch) spec otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    num_experts = tf_config.num_moe_experts if arch.moe else None
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_layernorm)
    return specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                          qk_layernorm=arch.qk_layernorm, normalization="RMSNorm")


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's rule: pad the vocab to a multiple of divisible_by * TP (extra rows are zero)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def build_gpt_chunks(spec, arch, tf_config, *, use_te: bool, model_cls=None, **model_kwargs) -> list:
    """One GPTModel per virtual pipeline stage of this rank (a single one without VPP).

    A model family built on GPTModel (Qwen3-VL) passes its subclass as `model_cls` and its extra
    constructor arguments (or overrides, e.g. `position_embedding_type`) as `model_kwargs`.
    """
    from megatron.core.models.gpt import GPTModel
    if spec.rope_type != "default" or spec.rope_theta is None:
        raise ValueError(f"{spec.model_type}: rope_type {spec.rope_type!r} (rope_theta {spec.rope_theta}) is not "
                         "supported; only the default RoPE with a rope_theta")
    c = coords()
    layers = layer_spec(tf_config, arch, use_te)
    model_kwargs = {"position_embedding_type": "rope", **model_kwargs}
    chunks = []
    for vp_stage in range(c.vpp):
        stage = vp_stage if c.vpp > 1 else None
        chunks.append((model_cls or GPTModel)(
            config=tf_config, transformer_layer_spec=layers,
            vocab_size=padded_vocab_size(spec.vocab_size, tf_config.tensor_model_parallel_size),
            max_sequence_length=spec.max_position_embeddings or 4096,
            pre_process=c.is_first_stage(stage), post_process=c.is_last_stage(stage),
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            rotary_base=spec.rope_theta, vp_stage=stage, **model_kwargs))
    return chunks


def gpt_inputs(micro, device, spec=None) -> dict:
    """A micro-batch's GPTModel inputs: token ids [b, S] and their positions 0..S-1 (each row
    starts at its own position 0: right padding only, no packing). `spec` is not needed here."""
    tokens = micro.tokens.to(device)
    positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)  # [b, S]
    return dict(input_ids=tokens, position_ids=positions, attention_mask=None)


def gpt_forward(model, inputs: dict) -> torch.Tensor:
    """Logits [b, S, V/TP] on the last pipeline stage, hidden states elsewhere."""
    return model(**inputs)
