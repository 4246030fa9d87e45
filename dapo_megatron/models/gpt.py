"""HF decoder-only config -> Megatron-Core `TransformerConfig`, layer spec and `GPTModel` chunks.

Covers Qwen2/2.5 (qkv bias), Qwen3 (qk-norm, explicit head_dim) and Qwen3-MoE (top-k router,
norm_topk_prob, no shared expert). Parallel degrees are read from Megatron's parallel state, so
they are set once, in `train/parallel.py`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def rope_theta(hf) -> float:
    """RoPE base; transformers 5 keeps it in `rope_parameters`, older configs in `rope_theta`."""
    params = getattr(hf, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {params['rope_type']!r} is not supported (only the default RoPE)")
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    if theta is None:
        raise ValueError("the HF config has no rope_theta")
    return float(theta)


def _moe_kwargs(hf) -> dict:
    if getattr(hf, "decoder_sparse_step", 1) != 1 or getattr(hf, "mlp_only_layers", []):
        raise ValueError("Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
                         "is not supported")
    # Megatron: pre_softmax=False is top-k on logits then softmax over the k, i.e. the
    # renormalised probabilities of norm_topk_prob=True; pre_softmax=True keeps raw softmax probs.
    return dict(num_moe_experts=hf.num_experts, moe_router_topk=hf.num_experts_per_tok,
                moe_ffn_hidden_size=hf.moe_intermediate_size,
                moe_router_pre_softmax=not hf.norm_topk_prob, moe_router_score_function="softmax",
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_router_dtype="fp32", moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
                moe_shared_expert_intermediate_size=None)


def gpt_config_kwargs(hf, arch) -> dict:
    """TransformerConfig kwargs that follow from the HF config (no parallel degrees, no dtype)."""
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kw = dict(num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
              num_attention_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads,
              kv_channels=head_dim, ffn_hidden_size=hf.intermediate_size, normalization="RMSNorm",
              layernorm_epsilon=hf.rms_norm_eps, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
              qk_layernorm=arch.qk_layernorm, gated_linear_unit=True, activation_func=F.silu,
              hidden_dropout=0.0, attention_dropout=0.0,
              # Fusions are CUDA kernels; the unfused paths are exact and run everywhere.
              bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
              apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
    if arch.moe:
        kw.update(_moe_kwargs(hf))
    return kw


def transformer_config(hf, arch, *, dtype: str = "fp32", sequence_parallel: bool = False,
                       use_cpu_initialization: bool = False, **overrides):
    """The Megatron TransformerConfig for `hf` at the current parallel state."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer import TransformerConfig
    tp, pp = mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size()
    vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
    if hf.num_hidden_layers % (pp * (vpp or 1)):
        raise ValueError(f"num_hidden_layers ({hf.num_hidden_layers}) must be divisible by "
                         f"actor.parallel.pp * vpp ({pp} * {vpp or 1})")
    if arch.moe and hf.num_experts % mpu.get_expert_model_parallel_world_size():
        raise ValueError(f"num_experts ({hf.num_experts}) must be divisible by actor.parallel.ep "
                         f"({mpu.get_expert_model_parallel_world_size()})")
    params_dtype = _DTYPES[dtype]
    kw = arch.config_fn(hf, arch)
    kw.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
              virtual_pipeline_model_parallel_size=vpp, context_parallel_size=mpu.get_context_parallel_world_size(),
              expert_model_parallel_size=mpu.get_expert_model_parallel_world_size(),
              expert_tensor_parallel_size=mpu.get_expert_tensor_parallel_world_size(),
              # Megatron refuses MoE with TP but without SP (tokens are split over TP for routing).
              sequence_parallel=tp > 1 and (sequence_parallel or arch.moe),
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


def build_gpt_chunks(hf, arch, tf_config, *, use_te: bool) -> list:
    """One GPTModel per virtual pipeline stage of this rank (a single one without VPP)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    spec = layer_spec(tf_config, arch, use_te)
    vpp = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
    chunks = []
    for vp_stage in range(vpp):
        stage = vp_stage if vpp > 1 else None
        chunks.append(GPTModel(
            config=tf_config, transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(hf.vocab_size, tf_config.tensor_model_parallel_size),
            max_sequence_length=hf.max_position_embeddings,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
            position_embedding_type="rope", rotary_base=rope_theta(hf), vp_stage=stage))
    return chunks
