"""Translate verl-style DAPO overrides (`actor_rollout_ref.actor.clip_ratio_high=0.28`) to ours.

One table maps verl keys to our keys. Keys that only tune verl's FSDP/worker performance have no
meaning here: they are reported with a warning. Keys whose only sensible value is our fixed
behaviour are accepted with that value and rejected with any other. Everything else is an error
that names the key, so a recipe command line never loses a setting silently.
"""
from __future__ import annotations

import re
import warnings

from dapo_megatron.config.errors import ConfigError

_A, _R, _RO = "actor_rollout_ref.actor.", "actor_rollout_ref.ref.", "actor_rollout_ref.rollout."
_MEGATRON_PARALLEL = {
    "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
    "virtual_pipeline_model_parallel_size": "vpp", "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp", "context_parallel_size": "cp",
    "sequence_parallel": "sequence_parallel",
}

VERL_TO_OURS: dict[str, str] = {
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.model.tokenizer_path": "model.tokenizer_path",
    **{_A + k: "actor." + k for k in (
        "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "ppo_mini_batch_size",
        "ppo_epochs", "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type")},
    _A + "ppo_max_token_len_per_gpu": "actor.max_tokens_per_microbatch",
    _A + "grad_clip": "actor.optim.clip_grad",
    _A + "clip_grad": "actor.optim.clip_grad",
    **{_A + "optim." + k: "actor.optim." + k for k in (
        "lr", "min_lr", "weight_decay", "lr_warmup_steps", "betas", "clip_grad")},
    _A + "optim.lr_scheduler_type": "actor.optim.lr_scheduler",
    _A + "optim.lr_decay_style": "actor.optim.lr_scheduler",
    **{_A + "megatron." + k: "actor.parallel." + v for k, v in _MEGATRON_PARALLEL.items()},
    **{_R + "megatron." + k: "ref.parallel." + v for k, v in _MEGATRON_PARALLEL.items()},
    **{_RO + k: "rollout." + k for k in (
        "n", "temperature", "top_p", "top_k", "name", "gpu_memory_utilization",
        "max_num_batched_tokens", "enforce_eager", "enable_prefix_caching")},
    _RO + "tensor_model_parallel_size": "rollout.parallel.tp",
    _RO + "expert_parallel_size": "rollout.parallel.ep",
    **{_RO + "val_kwargs." + k: "rollout.val_kwargs." + k for k in ("n", "temperature", "top_p", "top_k")},
    **{"reward_model.overlong_buffer." + k: "reward.overlong_buffer." + k
       for k in ("enable", "len", "penalty_factor", "log")},
}

# verl keys that tune verl's own FSDP / micro-batching machinery; ours is token-budget based.
PERFORMANCE_ONLY = re.compile(
    r"^actor_rollout_ref\.(actor|ref|rollout)\.(fsdp_config\..*|ulysses_sequence_parallel_size|"
    r"use_dynamic_bsz|ppo_micro_batch_size(_per_gpu)?|log_prob_micro_batch_size(_per_gpu)?|"
    r"log_prob_max_token_len_per_gpu|log_prob_use_dynamic_bsz|enable_chunked_prefill|free_cache_engine|"
    r"use_torch_compile|megatron\.(param_offload|grad_offload|optimizer_offload|use_dist_checkpointing)|"
    r"max_num_seqs|load_format|disable_log_stats)$"
    r"|^actor_rollout_ref\.model\.(enable_gradient_checkpointing|use_remove_padding|enable_activation_offload)$"
    r"|^data\.(filter_overlong_prompts_workers|return_raw_chat|dataloader_num_workers)$")

# verl keys whose only value here is our fixed behaviour.
FIXED_VALUES: dict[str, str] = {
    "reward_model.reward_manager": "dapo",
    "algorithm.use_kl_in_reward": "false",
    "actor_rollout_ref.actor.strategy": "megatron",
    "actor_rollout_ref.ref.strategy": "megatron",
    "data.filter_overlong_prompts": "true",
    "actor_rollout_ref.model.trust_remote_code": "false",
}


def _is_verl_key(key: str) -> bool:
    return key.startswith(("actor_rollout_ref.", "reward_model.", "custom_reward_function.")) \
        or key in FIXED_VALUES or bool(PERFORMANCE_ONLY.match(key))


def translate_overrides(overrides: list[str]) -> list[str]:
    """Rewrite verl-style `key=value` overrides to ours; non-verl overrides pass unchanged."""
    out, reward_fn = [], {}
    for item in overrides:
        prefix = re.match(r"^[+~]*", item).group(0)
        key, sep, value = item[len(prefix):].partition("=")
        if not _is_verl_key(key):
            out.append(item)
        elif key in VERL_TO_OURS:
            out.append(f"{prefix}{VERL_TO_OURS[key]}{sep}{value}")
        elif key in ("custom_reward_function.path", "custom_reward_function.name"):
            reward_fn[key.rsplit(".", 1)[1]] = value
        elif key in FIXED_VALUES:
            if value.strip().lower() != FIXED_VALUES[key]:
                raise ConfigError(key, f"verl option {key}={value} is not supported; dapo-megatron only "
                                       f"implements {key}={FIXED_VALUES[key]}; remove the override")
            warnings.warn(f"verl option {key}={value} is already dapo-megatron's behaviour; ignored")
        elif PERFORMANCE_ONLY.match(key):
            warnings.warn(f"verl performance option {key} has no meaning in dapo-megatron and is ignored "
                          f"(micro-batches come from actor.max_tokens_per_microbatch)")
        else:
            raise ConfigError(key, f"verl option {key} has no dapo-megatron equivalent; remove it "
                                   f"(see dapo_megatron/config/verl_compat.py for the translated keys)")
    if reward_fn:
        if "path" not in reward_fn:
            raise ConfigError("custom_reward_function.path", "custom_reward_function.name needs "
                                                             "custom_reward_function.path")
        out.append(f"reward.custom_fn={reward_fn['path']}:{reward_fn.get('name') or 'compute_score'}")
    return out
