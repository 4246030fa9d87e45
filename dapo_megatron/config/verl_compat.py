"""Translate a verl DAPO command line (`actor_rollout_ref.actor.clip_ratio_high=0.28`) to ours.

Every key of verl's DAPO recipe scripts and docs resolves to one outcome, by the tables below:
- translated: to our key (RENAMES, value kept) or our keys (VALUE_RULES, value mapped);
- accepted: the value is already our behaviour (FIXED_VALUES; another value is refused), or it
  repeats a key that is one setting here (SAME_AS; a different value is refused);
- ignored, with one warning: it tunes verl's own machinery (FSDP, Ulysses, micro-batch sizes,
  kernels) or sets a part this run does not have (a critic under GRPO); IGNORED, by class;
- refused: it asks for behaviour we do not have (UNSUPPORTED), and the message says what to do
  instead.
`resolve` gives each key's outcome (the migration helper prints them); `translate_overrides`
applies them, so a recipe command line never loses a setting silently.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Callable

from dapo_megatron.config.errors import ConfigError
from dapo_megatron.config.verl_fully_async import Plan, is_fully_async
from dapo_megatron.config.verl_losses import LOSS_RULES, RC as _RC
from dapo_megatron.config.verl_losses import bare as _bare, is_null as _is_null, is_true as _is_true, threshold as _threshold
from dapo_megatron.dtypes import BY_ANY_NAME

_ARR = "actor_rollout_ref."
_A, _R, _RO, _M = _ARR + "actor.", _ARR + "ref.", _ARR + "rollout.", _ARR + "model."
_MEGATRON_PARALLEL = {
    "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
    "virtual_pipeline_model_parallel_size": "vpp", "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp", "context_parallel_size": "cp",
    "sequence_parallel": "sequence_parallel",
}

_OTC = _A + "megatron.override_transformer_config."
_OOC = _A + "optim.override_optimizer_config."
_OVERLONG = ("enable", "len", "penalty_factor", "log")

# verl key -> our key, value unchanged.
RENAMES: dict[str, str] = {
    _M + "path": "model.path",
    _M + "tokenizer_path": "model.tokenizer_path",
    **{_A + k: "actor." + k for k in (
        "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "ppo_mini_batch_size",
        "ppo_epochs", "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type")},
    # the keys of verl's other policy losses (SAPO's temperatures, Clip-Cov, KL-Cov, DRO)
    **{_A + k: "actor.policy_loss_params." + k for k in ("tau_pos", "tau_neg")},
    **{_A + "policy_loss." + k: "actor.policy_loss_params." + k for k in (
        "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")},
    _A + "ppo_max_token_len_per_gpu": "actor.max_tokens_per_microbatch",
    _A + "grad_clip": "actor.optim.clip_grad",
    _A + "clip_grad": "actor.optim.clip_grad",
    **{_A + "optim." + k: "actor.optim." + k for k in (
        "lr", "min_lr", "weight_decay", "lr_warmup_steps", "betas", "clip_grad")},
    _A + "optim.lr_scheduler_type": "actor.optim.lr_scheduler",
    _A + "optim.lr_decay_style": "actor.optim.lr_scheduler",
    _A + "optim.use_distributed_optimizer": "actor.optim.use_distributed_optimizer",
    _OOC + "optimizer_offload_fraction": "actor.optim.cpu_offload_fraction",
    **{_A + "megatron." + k: "actor.parallel." + v for k, v in _MEGATRON_PARALLEL.items()},
    **{_R + "megatron." + k: "ref.parallel." + v for k, v in _MEGATRON_PARALLEL.items()},
    _OTC + "context_parallel_size": "actor.parallel.cp",
    _OTC + "recompute_granularity": "actor.recompute_granularity",
    _A + "megatron.dist_checkpointing_path": "model.load_checkpoint",
    **{_RO + k: "rollout." + k for k in (
        "n", "temperature", "top_p", "top_k", "name", "gpu_memory_utilization",
        "max_num_batched_tokens", "enforce_eager", "enable_prefix_caching", "ignore_eos")},
    _RO + "tensor_model_parallel_size": "rollout.parallel.tp",
    _RO + "expert_parallel_size": "rollout.parallel.ep",
    _RO + "max_num_seqs": "rollout.max_concurrent_per_engine",
    _RO + "update_weights_bucket_megabytes": "rollout.sync.bucket_mb",
    _RO + "checkpoint_engine.update_weights_bucket_megabytes": "rollout.sync.bucket_mb",
    **{_RO + "val_kwargs." + k: "rollout.val_kwargs." + k for k in ("n", "temperature", "top_p", "top_k")},
    _RO + "multi_turn.enable": "rollout.multi_turn.enable",
    _RO + "multi_turn.max_assistant_turns": "rollout.multi_turn.max_turns",
    _RO + "multi_turn.format": "rollout.multi_turn.format",
    # The overlong buffer's four homes over the recipe's history: custom_reward_function (early
    # 2025), reward_model, reward_model.reward_kwargs.overlong_buffer_cfg, reward.reward_kwargs (2026).
    **{prefix + k: "reward.overlong_buffer." + k for k in _OVERLONG for prefix in (
        "custom_reward_function.overlong_buffer.", "reward_model.overlong_buffer.",
        "reward_model.reward_kwargs.overlong_buffer_cfg.", "reward.reward_kwargs.overlong_buffer_cfg.")},
    "actor_rollout_ref.nccl_timeout": "trainer.dist_timeout_s",
    _RO + "nccl_timeout": "trainer.dist_timeout_s",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_checkpoints_to_keep",
    "trainer.resume_from_path": "trainer.resume_mode",
    "transfer_queue.num_data_storage_units": "data_plane.storage_units",
    "transfer_queue.total_storage_size": "data_plane.capacity",
}
# Prefixes renamed as a whole (free-form: every key below reaches the engines).
PREFIX_RENAMES: dict[str, str] = {_RO + "engine_kwargs.vllm.": "rollout.engine_kwargs."}


def _token_level_loss(value: str) -> list[str]:
    # The early DAPO recipe's switch: token-level (DAPO) or the per-sequence mean of token means (GRPO).
    return [f"actor.loss_agg_mode={'token-mean' if _is_true(value) else 'seq-mean-token-mean'}"]


def _do_sample(value: str) -> list[str]:
    return [] if _is_true(value) else ["rollout.val_kwargs.temperature=0.0"]  # greedy validation


def _logger(value: str) -> list[str]:
    v = value.strip()
    names = v if v.startswith("[") else f"[{_bare(v)}]"  # verl takes a bare name too
    return [f"trainer.logger={names}"]


def _set_bool(key: str) -> Callable[[str], list[str]]:
    return lambda value: [f"{key}={str(_is_true(value)).lower()}"]


def _cpu_optimizer(value: str) -> list[str]:
    # The CPU optimizer keeps the optimizer on the host all the time: nothing is left for
    # actor.offload.optimizer to move (verl's recipes set both; here the pair is refused).
    on = _is_true(value)
    return [f"actor.optim.cpu_offload={str(on).lower()}"] + (["actor.offload.optimizer=false"] if on else [])


def _filter_overlong(value: str) -> list[str]:
    # verl drops overlong prompts before it would truncate them: when on, filtering wins.
    return ["data.truncation=filter"] if _is_true(value) else []


def _resume_mode(value: str) -> list[str]:
    return [] if _bare(value) == "resume_path" else [f"trainer.resume_mode={_bare(value)}"]  # path: resume_from_path


def _strategy(value: str) -> list[str]:
    if _bare(value) not in ("megatron", "fsdp", "fsdp2"):
        raise ValueError(f"strategy {_bare(value)!r} is not megatron, fsdp or fsdp2")
    return []


def _dtype(value: str) -> list[str]:
    # One dtype for trainer and engines (the sync moves weights without casts).
    if _bare(value).lower() not in BY_ANY_NAME:
        raise ValueError(f"dtype {_bare(value)!r} is not one of {sorted(BY_ANY_NAME)}")
    return [f"model.dtype={BY_ANY_NAME[_bare(value).lower()].name}"]


def _gradient_checkpointing(value: str) -> list[str]:
    # FSDP's activation checkpointing is Megatron's full recompute.
    return ["actor.recompute_granularity=full"] if _is_true(value) else []


def _max_positions(value: str) -> list[str]:
    # Only the engines check the context against max_position_embeddings (RoPE has no table).
    return [f"rollout.engine_kwargs.hf_overrides.max_position_embeddings={_bare(value)}"]


_ROUTER_REPLAY = {"disabled": "off", "r2": "actor", "r3": "rollout"}


def _router_replay(value: str) -> list[str]:
    # verl's R2 records routes in the old-log-prob pass, R3 takes the engine's: our actor / rollout.
    mode = _bare(value).lower()
    if mode not in _ROUTER_REPLAY:
        raise ValueError(f"router_replay.mode={_bare(value)} is not one of disabled, R2, R3 "
                         f"(actor.router_replay=off | actor | rollout)")
    return [f"actor.router_replay={_ROUTER_REPLAY[mode]}"]


_ASYNC = ["trainer.mode=async", "trainer.placement=split", "algorithm.filter_groups.mode=early_stop"]


def _trainer_mode(value: str) -> list[str]:
    # verl's V1 trainer modes: separate_async is ours async (engines on devices of their own,
    # prompts streamed); colocate_async is not built.
    mode = _bare(value).lower()
    if mode == "separate_async":
        return list(_ASYNC)
    if mode != "sync":
        raise ValueError(f"trainer.v1.trainer_mode={_bare(value)} is not built: the overlap here is "
                         "trainer.mode=async (or one_step_off) with trainer.placement=split (the next batches "
                         "generate while this one trains, trainer.max_staleness weight pushes behind at most)")
    return ["trainer.mode=sync"]


def _lag_bound(value: str) -> list[str]:
    # verl's V1 bound on a sample's policy lag is our trainer.max_staleness (read in trainer.mode=async;
    # 0, on-policy, is trainer.mode=sync's lag)
    lag = _number(_bare(value))
    if lag is None or lag < 0 or lag != int(lag):
        raise ValueError(f"trainer.v1.sampler.max_off_policy_threshold={_bare(value)} is not a whole number of "
                         "policy versions >= 0")
    return [f"trainer.max_staleness={int(lag)}"] if lag > 1 else []  # 1: ours by default


# verl's strategy for a sample past the lag bound: dropped, or waited for (ours: a group carried
# across batches that the next batch would drop holds the batch it can still join).
def _lag_strategy(value: str) -> list[str]:
    strategy = _bare(value).lower()
    if strategy not in ("drop", "wait"):
        raise ValueError(f"trainer.v1.sampler.max_off_policy_strategy={_bare(value)} is not drop or wait")
    return [f"trainer.stale_strategy={strategy}"]


_FULLY_ASYNC = ("this key of verl's fully asynchronous recipe has no counterpart (the translated ones: "
                "config/verl_fully_async.py); the asynchronous mode here is trainer.mode=async with "
                "trainer.placement=split: trainer.max_staleness (policy versions a trained token may lag), "
                "trainer.stale_share, trainer.partial_rollout, rollout.num_devices (the engines' devices)")


# verl key -> its value mapped to our overrides (a ValueError refuses the value).
VALUE_RULES: dict[str, Callable[[str], list[str]]] = {
    _A + "use_token_level_loss": _token_level_loss,
    _RO + "val_kwargs.do_sample": _do_sample,
    "trainer.logger": _logger,
    **{_A + f"megatron.{k}_offload": _set_bool(f"actor.offload.{v}")
       for k, v in (("param", "params"), ("grad", "grads"), ("optimizer", "optimizer"))},
    _OOC + "optimizer_cpu_offload": _cpu_optimizer,
    _RO + "free_cache_engine": _set_bool("rollout.free_cache_engine"),
    _R + "megatron.param_offload": _set_bool("ref.offload"),
    "data.filter_overlong_prompts": _filter_overlong,
    "trainer.resume_mode": _resume_mode,
    _A + "strategy": _strategy,
    _R + "strategy": _strategy,
    _A + "megatron.dtype": _dtype,
    _RO + "dtype": _dtype,
    _M + "enable_gradient_checkpointing": _gradient_checkpointing,
    _M + "override_config.max_position_embeddings": _max_positions,
    _M + "override_config.model_config.max_position_embeddings": _max_positions,
    **LOSS_RULES,  # policy_loss.loss_mode and algorithm.rollout_correction.*: config/verl_losses.py
    **{_A + home + "router_replay.mode": _router_replay for home in ("", "megatron.", "mindspeed.")},
    "trainer.v1.trainer_mode": _trainer_mode,
    "trainer.use_v1": lambda v: [],  # which loop verl runs; ours is trainer.mode (v1.trainer_mode's)
    "trainer.v1.sampler.max_off_policy_threshold": _lag_bound,
    "trainer.v1.sampler.max_off_policy_strategy": _lag_strategy,
}
# Rules whose outcome must win over a key they override (Hydra keeps the last value).
LATE = (_RO + "val_kwargs.do_sample", "data.filter_overlong_prompts", "rollout.test_freq",
        # over policy_loss.loss_mode=bypass_mode's ppo_clip form
        "algorithm.rollout_correction.loss_type", "algorithm.rollout_correction.use_policy_gradient")
# Why a strategy value is accepted: the layout it trains with is ours.
STRATEGY_NOTE = ("dapo-megatron trains with the Megatron actor whatever the strategy; its layout is actor.parallel "
                 "(tp/pp/ep, default 1: data parallel over all devices, like FSDP)")

# verl key -> the one value that is our behaviour (anything else is refused: `what to do instead`).
_NO_DROPOUT = ("0.0", "training runs without dropout")
FIXED_VALUES: dict[str, tuple[str, str]] = {
    "reward_model.reward_manager": ("dapo", "the reward is DAPO's (math-verify + overlong shaping); "
                                            "for another one set reward.custom_fn=path/to/file.py:function"),
    "reward.reward_manager.name": ("dapo", "the reward is DAPO's (math-verify + overlong shaping); "
                                           "for another one set reward.custom_fn=path/to/file.py:function"),
    "reward_model.enable": ("false", "a learned reward model is not supported; score with "
                                     "reward.custom_fn=path/to/file.py:function"),
    "algorithm.adv_estimator": ("grpo", "GAE and the other estimators need a critic or other machinery that "
                                        "dapo-megatron does not have; DAPO uses grpo"),
    "algorithm.use_kl_in_reward": ("false", "KL in the reward is not implemented; use a KL loss instead "
                                            "(actor.use_kl_loss=true actor.kl_loss_coef=...) or set "
                                            "algorithm.kl_ctrl.kl_coef=0"),
    "algorithm.filter_groups.fill_to_train_bsz": ("true", "dynamic sampling always fills data.train_batch_size "
                                                          "(within algorithm.filter_groups.max_num_gen_batches)"),
    "algorithm.rollout_correction.rollout_is_batch_normalize": ("false", "IS weights are truncated or banded, "
                                                                         "not normalised to a batch mean of 1 "
                                                                         "(actor.rollout_correction)"),
    "data.return_raw_chat": ("true", "the driver applies the chat template itself"),
    "data.reward_fn_key": ("data_source", "the reward is chosen by each row's data_source"),
    _M + "trust_remote_code": ("false", "only the model types dapo-megatron builds itself are supported"),
    _M + "lora_rank": ("0", "LoRA is not supported: the actor trains all weights"),
    _RO + "mode": ("async", "requests are always streamed to the engines"),
    "transfer_queue.enable": ("true", "batches always move through the data plane (TransferQueue): the driver "
                                      "handles metadata only"),
    _RO + "calculate_log_probs": ("true", "the engines always return rollout_logprobs"),
    _RO + "data_parallel_size": ("1", "each engine is one replica (rollout.parallel.tp x ep devices); more "
                                      "replicas are more engines (rollout.num_engines)"),
    "algorithm.filter_groups.drop_last_mini_batch": ("true", "dynamic sampling fills data.train_batch_size, so "
                                                             "no mini-batch is partial"),
    _OTC + "recompute_method": ("uniform", "actor.recompute_granularity=full recomputes every layer uniformly"),
    _OTC + "recompute_num_layers": ("1", "actor.recompute_granularity=full recomputes one layer per checkpoint"),
    **{_M + "override_config." + k: _NO_DROPOUT for k in (
        "attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop")},
}

# verl key -> the verl key whose value it must repeat: the two are one setting here.
SAME_AS: dict[str, tuple[str, str]] = {
    "reward_model.reward_kwargs.max_resp_len": ("data.max_response_length", "the overlong penalty counts up to "
                                                                           "data.max_response_length"),
    "reward.reward_kwargs.max_resp_len": ("data.max_response_length", "the overlong penalty counts up to "
                                                                     "data.max_response_length"),
    _R + "megatron.dist_checkpointing_path": (_A + "megatron.dist_checkpointing_path", "the reference model "
                                              "starts from the actor's initial weights (model.load_checkpoint)"),
}

# Ignored with one warning, by class: (keys, why nothing is lost).
IGNORED: list[tuple[re.Pattern, str]] = [(re.compile(rx), why) for rx, why in [
    (r"^actor_rollout_ref\.rollout\.enable_rollout_routing_replay$",
     "the engines return routes whenever actor.router_replay=rollout (verl's router_replay.mode=R3)"),
    (r"^actor_rollout_ref\.(actor|ref|rollout)\.(use_dynamic_bsz|ppo_micro_batch_size(_per_gpu)?|"
     r"log_prob_micro_batch_size(_per_gpu)?|log_prob_max_token_len_per_gpu|log_prob_use_dynamic_bsz)$",
     "micro-batches are always packed to a token budget here: actor.max_tokens_per_microbatch"),
    (r"^actor_rollout_ref\.(actor|ref|rollout)\.(fsdp_config\..*|ulysses_sequence_parallel_size|use_torch_compile|"
     r"entropy_from_logits_with_chunking|entropy_checkpointing|checkpoint\..*|profiler\..*)$"
     r"|^actor_rollout_ref\.(hybrid_engine|model\.(use_remove_padding|enable_activation_offload|use_fused_kernels|"
     r"gradient_checkpointing_kwargs\..*))$",
     "tunes verl's FSDP workers; the actor here is Megatron-Core (layout: actor.parallel)"),
    (r"^actor_rollout_ref\.(actor|ref)\.megatron\.(override_transformer_config\.(apply_rope_fusion|attention_backend|"
     r"bias_activation_fusion|bias_dropout_fusion|gradient_accumulation_fusion|masked_softmax_fusion|"
     r"persist_layer_norm|moe_grouped_gemm|moe_permute_fusion|moe_token_dispatcher_type|moe_enable_deepep|"
     r"moe_shared_expert_overlap|moe_router_dtype|deallocate_pipeline_outputs|use_flash_attn|recompute_modules)|"
     r"use_mbridge|vanilla_mbridge|use_dist_checkpointing|use_remove_padding|seed)$",
     "a Megatron kernel or loader choice that the model spec and the device layer make"),
    (r"^actor_rollout_ref\.actor\.optim\.override_optimizer_config\.(overlap_cpu_optimizer_d2h_h2d|"
     r"use_precision_aware_optimizer)$",
     "actor.optim.cpu_offload=true runs Megatron's CPU optimizer precision-aware, its copies overlapped"),
    (r"^actor_rollout_ref\.actor\.optim\.override_optimizer_config\..*$",
     "of Megatron's optimizer overrides only the CPU optimizer's are read here (optimizer_cpu_offload, "
     "optimizer_offload_fraction: actor.optim.cpu_offload, actor.optim.cpu_offload_fraction)"),
    (r"^actor_rollout_ref\.rollout\.(enable_chunked_prefill|load_format|disable_log_stats|"
     r"max_model_len|swap_space|multi_stage_wake_up|layered_summon)$",
     "the engines' setting is derived: chunked prefill by rollout.max_num_batched_tokens, the context is "
     "data.max_prompt_length + data.max_response_length, the weights come from the actor at each sync, "
     "and waking is always two-stage (weights for the sync, then the KV cache)"),
    (r"^data\.(filter_overlong_prompts_workers|dataloader_num_workers|use_shm|min_response_length)$",
     "verl's data-loader machinery (min_response_length is read nowhere in verl either)"),
    (r"^data\.val_batch_size$",
     "deprecated in verl, which sends the validation set whole; so does this run: each engine gets its shard "
     "at once and runs rollout.max_concurrent_per_engine of it at a time"),
    (r"^trainer\.(balance_batch|log_val_generations|rollout_data_dir|validation_data_dir|del_local_ckpt_after_load|"
     r"use_legacy_worker_impl|ray_wait_register_center_timeout)$|^ray_(init|kwargs)\..*$|^global_profiler\..*$",
     "verl's trainer, logging or Ray set-up machinery"),
    (r"^transfer_queue\.(?!enable$|num_data_storage_units$|total_storage_size$).*$",
     "tunes TransferQueue's controller, sampler or transport; the data plane sets them (data_plane.*)"),
    (r"^critic\..*$|^reward_model\.(?!enable$|reward_manager$|overlong_buffer\.|reward_kwargs\.).*$|"
     r"^algorithm\.(kl_ctrl\..*|gamma|lam|pf_ppo\..*|use_pf_ppo)$|^trainer\.(critic_warmup|max_critic_ckpt_to_keep)$",
     "sets a part this run does not have (no critic, no reward model, no KL in the reward)"),
]]
# Refused by class: behaviour we do not have, and what to do instead.
UNSUPPORTED: list[tuple[re.Pattern, str]] = [(re.compile(rx), why) for rx, why in [
    (r"^actor_rollout_ref\.rollout\.multi_turn\.tool_config_path$",
     "tools are listed in rollout.tools (built-in python, or path/to/file.py:function entries)"),
    (r"^actor_rollout_ref\.actor\.megatron\.override_transformer_config\.fp8(_recipe)?$|"
     r"^actor_rollout_ref\.rollout\.quantization$",
     "fp8 training and quantized rollout are not supported; train in model.dtype=bf16"),
    (r"^actor_rollout_ref\.actor\.megatron\.override_transformer_config\.num_layers_in_(first|last)_pipeline_stage$",
     "uneven pipeline stages are not supported; choose actor.parallel.pp dividing the layer count "
     "(or actor.parallel.vpp)"),
    (r"^async_training\..*$|^trainer\.v1\.separate_async\..*$|^rollout\.(nnodes|n_gpus_per_node|total_rollout_steps|"
     r"test_freq|total_epochs)$|^algorithm\.filter_groups\.max_inflight_gen_batches$", _FULLY_ASYNC),
    (r"^actor_rollout_ref\.model\.override_config\..*$",
     "model config overrides other than zero dropout and max_position_embeddings are not applied; edit the "
     "model's config.json instead"),
]]
_VERL_ONLY_PREFIXES = ("actor_rollout_ref.", "reward_model.", "custom_reward_function.", "critic.",
                       "transfer_queue.", "algorithm.rollout_correction.", "reward.reward_kwargs.",
                       "reward.reward_manager.")


@dataclass(frozen=True)
class Outcome:
    """What became of one verl `key=value`."""
    key: str
    value: str
    action: str  # translated | accepted | ignored | refused | ours (already our key)
    ours: tuple[str, ...] = ()  # the overrides it became
    reason: str = ""
    warn: bool = False  # say it on the console (every ignored key; an accepted value that reads otherwise)


def _first(table: list[tuple[re.Pattern, str]], key: str) -> str | None:
    return next((why for rx, why in table if rx.match(key)), None)


def is_verl_key(key: str) -> bool:
    return (key.startswith(_VERL_ONLY_PREFIXES) or key in RENAMES or key in VALUE_RULES or key in FIXED_VALUES
            or key in SAME_AS or _first(IGNORED, key) is not None or _first(UNSUPPORTED, key) is not None)


def _resolve_one(key: str, value: str) -> Outcome:
    bare = _bare(value)
    if key in RENAMES:
        return Outcome(key, value, "translated", (f"{RENAMES[key]}={value}",))
    for verl, ours in PREFIX_RENAMES.items():
        if key.startswith(verl):
            return Outcome(key, value, "translated", (f"{ours}{key[len(verl):]}={value}",))
    if key in VALUE_RULES:
        try:
            mapped = tuple(VALUE_RULES[key](value))
        except ValueError as exc:
            return Outcome(key, value, "refused", reason=str(exc))
        if key.endswith(".strategy"):
            return Outcome(key, value, "accepted", reason=STRATEGY_NOTE, warn=bare != "megatron")
        return Outcome(key, value, "translated", mapped)
    if key in FIXED_VALUES:
        ours, instead = FIXED_VALUES[key]
        same = bare.lower() == ours or (_number(bare) is not None and _number(bare) == _number(ours))
        if same:
            return Outcome(key, value, "accepted", reason=f"{key}={ours} is dapo-megatron's behaviour")
        return Outcome(key, value, "refused", reason=f"{key}={bare} is not supported: {instead}")
    if (why := _first(UNSUPPORTED, key)) is not None:
        return Outcome(key, value, "refused", reason=f"{key}: {why}")
    if (why := _first(IGNORED, key)) is not None:
        return Outcome(key, value, "ignored", reason=why, warn=True)
    return Outcome(key, value, "refused", reason=f"verl option {key} has no dapo-megatron equivalent; remove it "
                                                 f"(the translated keys: dapo_megatron/config/verl_compat.py)")


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return None


def resolve(overrides: list[str]) -> list[Outcome]:
    """The outcome of every override (ours pass as `ours`); some keys depend on another's value."""
    items = []
    for item in overrides:
        prefix = re.match(r"^[+~]*", item).group(0)
        key, _, value = item[len(prefix):].partition("=")
        items.append((item, key, value))
    values = {key: _bare(value) for _, key, value in items}
    plan = Plan(values) if is_fully_async(values) else None
    return [_fully_async(plan, key, value) if plan is not None and plan.handles(key)
            else _cross_key(key, value, values) if key in SAME_AS or key in _CROSS_KEYS
            else _added_key(item, _resolve_one(key, value)) if is_verl_key(key)
            else Outcome(key, value, "ours", (item,)) for item, key, value in items]


def _fully_async(plan: Plan, key: str, value: str) -> Outcome:
    """A key of verl's fully asynchronous recipe: its outcome reads the script's other keys."""
    try:
        action, ours, reason = plan.outcome(key)
    except ValueError as exc:
        return Outcome(key, value, "refused", reason=str(exc))
    return Outcome(key, value, action, ours, reason, warn=action == "ignored")


# Where a `+`-added key is handed on to code that reads it (a reward function's kwargs, a model or
# engine override): an unknown one there may matter, so it stays refused.
_PASSED_ON = re.compile(r"\.(reward_kwargs|override_config|override_transformer_config|engine_kwargs)\.")


def _added_key(item: str, outcome: Outcome) -> Outcome:
    """A key that verl's config does not define, added with `+` (or `++`) and read by no verl code
    (recipes carry such leftovers, e.g. `+actor_rollout_ref.critic.optim.lr`): ignored with one
    warning, where a key verl defines and we do not know stays refused."""
    generic = outcome.action == "refused" and "has no dapo-megatron equivalent" in (outcome.reason or "")
    if generic and item.startswith("+") and not _PASSED_ON.search(outcome.key):
        return Outcome(outcome.key, outcome.value, "ignored", warn=True,
                       reason="added with + and not a key of verl's config: verl itself never reads it")
    return outcome


_BYPASS_LOSS = ("algorithm.rollout_correction.loss_type", "algorithm.rollout_correction.use_policy_gradient")
_SYNC_STEP = "trainer.v1.separate_async.parameter_sync_step"
_CROSS_KEYS = ("custom_reward_function.path", "custom_reward_function.name", "algorithm.use_kl_in_reward",
               "algorithm.rollout_correction.rollout_is_threshold", _A + "megatron.optimizer_offload", *_BYPASS_LOSS,
               _SYNC_STEP)


def _sync_step(key: str, value: str, values: dict[str, str]) -> Outcome:
    """verl V1's separate_async trains each of a step's parameter_sync_step mini-batches as soon as
    it can be sampled and pushes after the last; its invariant is data.train_batch_size =
    parameter_sync_step x ppo_mini_batch_size (docs/advance/v1_async_trainer.md): our streamed
    mini-batches."""
    k = _number(_bare(value))
    if k == 1:
        return Outcome(key, value, "accepted", reason="one mini-batch a push: a step here")
    batch, mini = (_number(values.get(name, "x")) for name in ("data.train_batch_size", _A + "ppo_mini_batch_size"))
    if k is None or k < 1 or k != int(k) or batch is None or mini is None or batch != k * mini:
        return Outcome(key, value, "refused", reason=(
            f"{key}={_bare(value)}: verl V1 trains data.train_batch_size = parameter_sync_step x "
            f"actor_rollout_ref.actor.ppo_mini_batch_size prompts a push (got {values.get('data.train_batch_size')} "
            f"and {values.get(_A + 'ppo_mini_batch_size')}); give both so that they agree"))
    return Outcome(key, value, "translated", ("trainer.stream_minibatches=true",), reason=(
        "each mini-batch trains as its groups are in, the push after the last (verl keeps the step's first "
        "weights as pi_old; here each mini-batch's proximal policy is the weights before its step, with the "
        "decoupled correction)"))


def _cross_key(key: str, value: str, values: dict[str, str]) -> Outcome:
    """Keys whose outcome depends on another key's value."""
    v = _bare(value)
    if key in SAME_AS:
        other, why = SAME_AS[key]
        if values.get(other, v) == v:
            return Outcome(key, value, "accepted", reason=f"one setting here with {other}: {why}")
        return Outcome(key, value, "refused", reason=f"{key}={v} differs from {other}={values[other]}: {why}; "
                                                       f"set them equal")
    if key == "algorithm.use_kl_in_reward":
        if _is_true(v) and _number(values.get("algorithm.kl_ctrl.kl_coef", "x")) == 0:
            return Outcome(key, value, "accepted", reason="algorithm.kl_ctrl.kl_coef=0: no KL in the reward")
        return _resolve_one(key, value)
    if key == "algorithm.rollout_correction.rollout_is_threshold":
        # unset, rollout_is leaves our default level (auto: token weights in the off-policy modes), which
        # this bounds; null turns the weights off
        if _is_null(values.get("algorithm.rollout_correction.rollout_is", "x")):
            return Outcome(key, value, "ignored", reason="no effect with algorithm.rollout_correction.rollout_is=null",
                           warn=True)
        band = "_" in v  # "lower_upper": IcePop's band, tokens outside it masked
        return Outcome(key, value, "translated",
                       tuple(_threshold(f"{_RC}is_threshold", v)) + ((f"{_RC}is_mode=mask",) if band else ()))
    if key == _SYNC_STEP:
        return _sync_step(key, value, values)
    if key in _BYPASS_LOSS:
        bypass = _is_true(values.get("algorithm.rollout_correction.bypass_mode", "false")) or \
            _bare(values.get(_A + "policy_loss.loss_mode", "")).lower() == "bypass_mode"
        if not bypass:
            return Outcome(key, value, "ignored", warn=True, reason="read in bypass mode only (in verl too): "
                           "algorithm.rollout_correction.bypass_mode=true")
        return _resolve_one(key, value)
    if key == _A + "megatron.optimizer_offload":
        if _is_true(v) and _is_true(values.get(_OOC + "optimizer_cpu_offload", "false")):
            return Outcome(key, value, "translated", ("actor.offload.optimizer=false",),
                           reason="the CPU optimizer (optimizer_cpu_offload) keeps the optimizer on the host already")
        return _resolve_one(key, value)
    if "custom_reward_function.path" not in values:
        return Outcome(key, value, "refused", reason="custom_reward_function.name needs custom_reward_function.path")
    if key == "custom_reward_function.name":
        return Outcome(key, value, "translated", reason="with custom_reward_function.path")
    fn = values.get("custom_reward_function.name") or "compute_score"
    return Outcome(key, value, "translated", (f"reward.custom_fn={v}:{fn}",))


def ordered_overrides(outcomes: list[Outcome]) -> list[str]:
    """Our overrides from the outcomes, refused ones left out, the LATE rules last (Hydra keeps the
    last value)."""
    return [x for o in sorted(outcomes, key=lambda o: o.key in LATE) if o.action != "refused" for x in o.ours]


def translate_overrides(overrides: list[str]) -> list[str]:
    """Rewrite verl-style overrides to ours (one warning per ignored key); refuse with the reason."""
    outcomes = resolve(overrides)
    for o in outcomes:
        if o.action == "refused":
            raise ConfigError(o.key, o.reason)
        if o.warn:
            warnings.warn(f"verl option {o.key}={o.value} {o.action}: {o.reason}")
    return ordered_overrides(outcomes)
