"""verl DAPO keys, one test per class: each resolves to our config as the table says (the value
keeps its meaning), is ignored with one warning, or is refused with what to do instead."""
from __future__ import annotations

import warnings

import pytest

from dapo_megatron.config import ConfigError, load_config
from dapo_megatron.config.load import schema_keys
from dapo_megatron.config.verl_compat import FIXED_VALUES, RENAMES, resolve


def _cfg(*overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config("quickstart", list(overrides))


def _get(cfg, dotted):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


# The quickstart on split placement (quickstart_async's layout): what verl's separate async modes need.
SPLIT = ["rollout.num_devices=1", "actor.parallel.ep=1", "ref.parallel.ep=1", "actor.offload.params=false",
         "actor.offload.grads=false", "actor.offload.optimizer=false"]

# (verl overrides, our key, expected value): the value keeps its meaning.
TRANSLATED = [
    (["custom_reward_function.overlong_buffer.enable=True", "custom_reward_function.overlong_buffer.len=4",
      "custom_reward_function.overlong_buffer.penalty_factor=0.5"], "reward.overlong_buffer.penalty_factor", 0.5),
    (["reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=4"], "reward.overlong_buffer.len", 4),
    (["actor_rollout_ref.actor.use_token_level_loss=True"], "actor.loss_agg_mode", "token-mean"),
    (["actor_rollout_ref.actor.use_token_level_loss=False"], "actor.loss_agg_mode", "seq-mean-token-mean"),
    (["actor_rollout_ref.rollout.val_kwargs.do_sample=False", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0"],
     "rollout.val_kwargs.temperature", 0.0),  # greedy, whatever the order
    (["actor_rollout_ref.rollout.val_kwargs.do_sample=True", "actor_rollout_ref.rollout.val_kwargs.temperature=0.7"],
     "rollout.val_kwargs.temperature", 0.7),
    (["trainer.logger=console"], "trainer.logger", ["console"]),
    (["trainer.logger=['console','wandb']"], "trainer.logger", ["console", "wandb"]),
    (["+trainer.val_before_train=False"], "trainer.val_before_train", False),
    (["data.truncation=left", "data.filter_overlong_prompts=True"], "data.truncation", "filter"),
    (["data.filter_overlong_prompts=False", "data.truncation=right"], "data.truncation", "right"),
    (["+actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True"],
     "rollout.engine_kwargs", {"disable_mm_preprocessor_cache": True}),
    (["actor_rollout_ref.actor.megatron.param_offload=True"], "actor.offload.params", True),
    (["actor_rollout_ref.actor.megatron.optimizer_offload=True"], "actor.offload.optimizer", True),
    (["actor_rollout_ref.rollout.free_cache_engine=False"], "rollout.free_cache_engine", False),
    (["actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full"],
     "actor.recompute_granularity", "full"),
    (["actor_rollout_ref.actor.megatron.dist_checkpointing_path=/ckpt"], "model.load_checkpoint", "/ckpt"),
    (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1",
      "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=2", "actor_rollout_ref.ref.megatron.expert_model_parallel_size=1"],
     "actor.parallel.tp", 2),
    (["actor_rollout_ref.rollout.max_num_seqs=32"], "rollout.max_concurrent_per_engine", 32),
    (["actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=512"], "rollout.sync.bucket_mb", 512),
    (["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpt/global_step_5"], "trainer.resume_mode",
     "/ckpt/global_step_5"),
    # The overlong buffer's later homes (2025: reward_kwargs.overlong_buffer_cfg; 2026: the reward.* namespace).
    (["+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True", "+reward_model.reward_kwargs.overlong_buffer_cfg.len=6",
      "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.3"], "reward.overlong_buffer.penalty_factor", 0.3),
    (["reward.reward_kwargs.overlong_buffer_cfg.enable=True", "reward.reward_kwargs.overlong_buffer_cfg.len=7"],
     "reward.overlong_buffer.len", 7),
    (["actor_rollout_ref.actor.megatron.grad_offload=True"], "actor.offload.grads", True),
    (["actor_rollout_ref.actor.megatron.dtype=float16"], "model.dtype", "fp16"),
    (["actor_rollout_ref.rollout.dtype=bfloat16"], "model.dtype", "bf16"),
    (["actor_rollout_ref.nccl_timeout=7200"], "trainer.dist_timeout_s", 7200),
    (["actor_rollout_ref.model.enable_gradient_checkpointing=True"], "actor.recompute_granularity", "full"),
    (["+actor_rollout_ref.actor.megatron.override_transformer_config.context_parallel_size=1"], "actor.parallel.cp", 1),
    (["+actor_rollout_ref.model.override_config.max_position_embeddings=32768"], "rollout.engine_kwargs",
     {"hf_overrides": {"max_position_embeddings": 32768}}),
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0"],
     "actor.rollout_correction.is_threshold", 2.0),
    (["algorithm.rollout_correction.rollout_is=sequence"], "actor.rollout_correction.is_level", "sequence"),
    # IcePop's band: a "lower_upper" threshold masks outside it
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=0.5_5.0"],
     "actor.rollout_correction.is_mode", "mask"),
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=0.5_5.0"],
     "actor.rollout_correction.is_threshold_lower", 0.5),
    # verl's first rejection API (R06: geometric, ratio bounds 0.99 / 1.01, a veto) and its newer names
    (["algorithm.rollout_correction.rollout_rs=geometric", "algorithm.rollout_correction.rollout_rs_threshold=1.01",
      "algorithm.rollout_correction.rollout_rs_threshold_lower=0.99"], "actor.rollout_correction.rs", "seq_mean_k1"),
    (["algorithm.rollout_correction.rollout_rs=geometric", "algorithm.rollout_correction.rollout_rs_threshold=1.01",
      "algorithm.rollout_correction.rollout_rs_threshold_lower=0.99"], "actor.rollout_correction.rs_threshold_lower",
     0.99),
    (["algorithm.rollout_correction.rollout_token_veto_threshold=1e-4"], "actor.rollout_correction.veto_threshold",
     1e-4),
    (["algorithm.rollout_correction.rollout_rs=seq_mean_k3", "algorithm.rollout_correction.rollout_rs_threshold=0.005"],
     "actor.rollout_correction.rs_threshold", 0.005),
    (["algorithm.rollout_correction.rollout_rs=token_k1", "algorithm.rollout_correction.rollout_rs_threshold=0.5_1.5"],
     "actor.rollout_correction.rs_threshold_lower", 0.5),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=cispo"], "actor.policy_loss", "cispo"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"], "actor.loss_agg_mode", "seq-mean-token-mean"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=vanilla"], "actor.policy_loss", "dapo"),
    # verl's other registered losses: a row each, their keys on actor.policy_loss_params
    *[([f"actor_rollout_ref.actor.policy_loss.loss_mode={m}", "+actor_rollout_ref.actor.policy_loss.dro_beta=0.1"],
       "actor.policy_loss", m) for m in ("sapo", "geo_mean", "clip_cov", "kl_cov", "gpg", "dro", "dppo_tv", "dppo_kl")],
    (["actor_rollout_ref.actor.policy_loss.loss_mode=sapo"], "actor.loss_agg_mode", "seq-mean-token-mean"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean"], "actor.loss_agg_mode", "seq-mean-token-mean"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "+actor_rollout_ref.actor.tau_neg=2.5"],
     "actor.policy_loss_params.tau_neg", 2.5),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "+actor_rollout_ref.actor.policy_loss.clip_cov_ub=4.0"],
     "actor.policy_loss_params.clip_cov_ub", 4.0),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov", "+actor_rollout_ref.actor.policy_loss.ppo_kl_coef=1.0"],
     "actor.policy_loss_params.ppo_kl_coef", 1.0),
    (["data.train_files=/data/a.parquet"], "data.train_files", ["/data/a.parquet"]),  # verl takes one file bare
    (["actor_rollout_ref.actor.megatron.router_replay.mode=R2"], "actor.router_replay", "actor"),
    (["+actor_rollout_ref.actor.router_replay.mode=disabled"], "actor.router_replay", "off"),
    (["+actor_rollout_ref.actor.mindspeed.router_replay.mode=R3"], "actor.router_replay", "rollout"),
    (["actor_rollout_ref.rollout.multi_turn.enable=True"], "rollout.multi_turn.enable", True),
    (["actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5"], "rollout.multi_turn.max_turns", 5),
    (["++transfer_queue.num_data_storage_units=4"], "data_plane.storage_units", 4),
    (["++transfer_queue.enable=True"], "data_plane.backend", "transfer_queue"),
    (["actor_rollout_ref.rollout.ignore_eos=True"], "rollout.ignore_eos", True),
    (["+trainer.use_v1=True", "+trainer.v1.trainer_mode=sync"], "trainer.mode", "sync"),
    (["+trainer.v1.sampler.max_off_policy_threshold=1", "+trainer.v1.sampler.max_off_policy_strategy=drop"],
     "trainer.mode", "sync"),
    (["+trainer.v1.trainer_mode=separate_async", "+trainer.v1.sampler.max_off_policy_threshold=2",
      "+trainer.v1.separate_async.parameter_sync_step=1", *SPLIT], "trainer.max_staleness", 2),
    (["+trainer.v1.trainer_mode=separate_async", *SPLIT], "algorithm.filter_groups.mode", "early_stop"),
    (["+async_training.partial_rollout=False", "+async_training.staleness_threshold=1", *SPLIT],
     "trainer.partial_rollout", False),
    # verl's fully asynchronous recipe: a step is a push period, the threshold a share of stale groups
    (["+async_training.staleness_threshold=0.5", *SPLIT], "trainer.stale_share", 0.5),
    (["+async_training.staleness_threshold=0.5", *SPLIT], "trainer.max_staleness", 1),
    (["+async_training.staleness_threshold=0", *SPLIT], "trainer.mode", "sync"),
    (["+async_training.staleness_threshold=2", *SPLIT], "trainer.max_staleness", 2),
    (["+async_training.staleness_threshold=2", *SPLIT], "trainer.stale_share", None),
    (["+async_training.trigger_parameter_sync_step=4", "+async_training.require_batches=2",
      "actor_rollout_ref.actor.ppo_mini_batch_size=3", *SPLIT], "data.train_batch_size", 24),
    (["+async_training.trigger_parameter_sync_step=4", "+async_training.require_batches=2",
      "actor_rollout_ref.actor.ppo_mini_batch_size=3", *SPLIT], "actor.ppo_mini_batch_size", 6),
    (["+async_training.trigger_parameter_sync_step=4", "+async_training.require_batches=2",
      "actor_rollout_ref.actor.ppo_mini_batch_size=3", *SPLIT], "trainer.stream_minibatches", True),
    # verl V1: a push every parameter_sync_step mini-batches, each trained as it is in
    (["+trainer.v1.trainer_mode=separate_async", "+trainer.v1.separate_async.parameter_sync_step=4",
      "data.train_batch_size=64", "data.gen_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16", *SPLIT],
     "trainer.stream_minibatches", True),
    (["+async_training.trigger_parameter_sync_step=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
      "+rollout.total_rollout_steps=100", *SPLIT], "trainer.total_training_steps", 12),
    (["+async_training.use_rollout_log_probs=True", *SPLIT], "actor.old_logprobs", "rollout"),
    (["+async_training.compute_prox_log_prob=True", *SPLIT], "actor.old_logprobs", "auto"),
    (["+async_training.compute_prox_log_prob=True", *SPLIT], "actor.rollout_correction.is_level", "token"),
    (["trainer.test_freq=3", "+rollout.test_freq=5", *SPLIT], "trainer.test_freq", 5),
    (["+async_training.checkpoint_engine.device_buffer_size_M=512", *SPLIT], "rollout.sync.bucket_mb", 512),
    (["+trainer.v1.sampler.max_off_policy_strategy=wait", "+trainer.v1.trainer_mode=separate_async", *SPLIT],
     "trainer.stale_strategy", "wait"),
    (["algorithm.rollout_correction.rollout_is=geometric"], "actor.rollout_correction.is_level", "geometric"),
    (["algorithm.rollout_correction.bypass_mode=True"], "actor.old_logprobs", "rollout"),
    (["algorithm.rollout_correction.bypass_mode=False"], "actor.old_logprobs", "auto"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"], "actor.old_logprobs", "rollout"),
    # bypass mode's REINFORCE form, its weight the correction's level (verl reads loss_type in bypass mode only)
    (["algorithm.rollout_correction.bypass_mode=True", "algorithm.rollout_correction.loss_type=reinforce",
      "algorithm.rollout_correction.rollout_is=token"], "actor.policy_loss", "reinforce"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode", "algorithm.rollout_correction.loss_type=reinforce"],
     "actor.policy_loss", "reinforce"),
    (["algorithm.rollout_correction.bypass_mode=True", "+algorithm.rollout_correction.use_policy_gradient=True"],
     "actor.policy_loss", "reinforce"),
    (["algorithm.rollout_correction.loss_type=reinforce"], "actor.policy_loss", "dapo"),
    (["algorithm.rollout_correction.bypass_mode=True", "algorithm.rollout_correction.loss_type=ppo_clip"],
     "actor.policy_loss", "dapo"),
    # the off-policy modes weigh tokens by default (is_level=auto): verl's threshold bounds those weights,
    # and its null said aloud turns them off
    (["+trainer.v1.trainer_mode=separate_async", *SPLIT], "actor.rollout_correction.is_level", "token"),
    (["+trainer.v1.trainer_mode=separate_async", "algorithm.rollout_correction.rollout_is_threshold=3.0", *SPLIT],
     "actor.rollout_correction.is_threshold", 3.0),
    (["+trainer.v1.trainer_mode=separate_async", "algorithm.rollout_correction.rollout_is=null", *SPLIT],
     "actor.rollout_correction.is_level", None),
]


@pytest.mark.parametrize("overrides,key,value", TRANSLATED, ids=[t[0][0].split("=")[0] + "=" + t[0][0].split("=")[1][:12]
                                                                  for t in TRANSLATED])
def test_translated(overrides, key, value):
    assert _get(_cfg(*overrides), key) == value


ACCEPTED = [
            "algorithm.use_kl_in_reward=False", "reward_model.reward_manager=dapo", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.model.override_config.attention_dropout=0.",
            "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1",
            "reward.reward_manager.name=dapo", "actor_rollout_ref.model.override_config.resid_pdrop=0.",
            "algorithm.filter_groups.fill_to_train_bsz=True", "actor_rollout_ref.model.lora_rank=0",
            "actor_rollout_ref.rollout.data_parallel_size=1", "algorithm.filter_groups.drop_last_mini_batch=True"]


# A verl key that repeats another one: accepted when the two agree, refused (naming both) when not.
SAME_AS_CASES = [
    (["data.max_response_length=64", "+reward_model.reward_kwargs.max_resp_len=64"], None),
    (["data.max_response_length=64", "reward.reward_kwargs.max_resp_len=32"], "data.max_response_length=64"),
    (["actor_rollout_ref.actor.megatron.dist_checkpointing_path=/a", "actor_rollout_ref.ref.megatron.dist_checkpointing_path=/a"], None),
    (["actor_rollout_ref.actor.megatron.dist_checkpointing_path=/a", "actor_rollout_ref.ref.megatron.dist_checkpointing_path=/b"],
     "model.load_checkpoint"),
]


@pytest.mark.parametrize("overrides,refusal", SAME_AS_CASES, ids=["max_resp_len-same", "max_resp_len-differs",
                                                                  "ref-ckpt-same", "ref-ckpt-differs"])
def test_repeated_setting_must_agree(overrides, refusal):
    second = resolve(overrides)[1]
    if refusal is None:
        assert second.action == "accepted" and second.ours == (), second
        assert _cfg(*overrides) == _cfg(overrides[0])
    else:
        with pytest.raises(ConfigError) as err:
            _cfg(*overrides)
        assert err.value.key == overrides[1].lstrip("+").split("=")[0] and refusal in str(err.value), str(err.value)


@pytest.mark.parametrize("item", ACCEPTED)
def test_accepted_value_is_our_behaviour(item):
    (o,) = resolve([item])
    assert o.action == "accepted" and o.ours == (), o
    assert _cfg(item) == _cfg()


def test_kl_in_reward_with_zero_coefficient_is_accepted():
    both = ["algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.kl_coef=0.0"]
    assert {o.key: o.action for o in resolve(both)} == {"algorithm.use_kl_in_reward": "accepted",
                                                         "algorithm.kl_ctrl.kl_coef": "ignored"}
    assert _cfg(*both) == _cfg()


def test_fsdp_strategy_trains_with_megatron_and_says_so():
    with pytest.warns(UserWarning, match="Megatron actor.*actor.parallel"):
        cfg = load_config("quickstart", ["actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2"])
    assert cfg.actor.parallel.ep == 2  # the config's own layout


IGNORED = ["actor_rollout_ref.actor.fsdp_config.param_offload=True", "+actor_rollout_ref.rollout.enable_rollout_routing_replay=True", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.model.use_remove_padding=True",
           "actor_rollout_ref.rollout.enable_chunked_prefill=True", "critic.strategy=fsdp2", "critic.optim.lr=1e-5",
           "algorithm.kl_ctrl.kl_coef=0.001", "trainer.balance_batch=True", "reward_model.model.path=/rm",
           "actor_rollout_ref.actor.megatron.use_dist_checkpointing=True",
           "+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=True",
           "actor_rollout_ref.actor.megatron.vanilla_mbridge=False",
           "+actor_rollout_ref.actor.optim.override_optimizer_config.use_torch_optimizer_for_cpu_offload=True",
           "actor_rollout_ref.rollout.max_model_len=22528", "++transfer_queue.controller.polling_mode=True",
           "+data.min_response_length=4096", "trainer.log_val_generations=10", "data.val_batch_size=64",
           # `+`-added keys that verl's config lacks and no verl code reads (the 2025 NPU recipe's)
           "+actor_rollout_ref.critic.optim.lr=5e-8", "+actor_rollout_ref.rollout.rollout_world_size=16"]


def test_a_threshold_with_rollout_is_null_is_ignored_with_one_warning():
    with pytest.warns(UserWarning, match=r"rollout_is_threshold") as record:
        cfg = load_config("quickstart", ["algorithm.rollout_correction.rollout_is=null",
                                         "algorithm.rollout_correction.rollout_is_threshold=3.0"])
    assert len([w for w in record if "ignored" in str(w.message)]) == 1
    assert cfg == _cfg() and cfg.actor.rollout_correction.is_threshold == 2.0


@pytest.mark.parametrize("item", IGNORED)
def test_ignored_with_one_warning(item):
    with pytest.warns(UserWarning, match=item.lstrip("+").split("=")[0].replace(".", r"\.")) as record:
        cfg = load_config("quickstart", [item])
    assert len([w for w in record if "ignored" in str(w.message)]) == 1
    assert cfg == _cfg()


def test_cpu_optimizer_keys_of_verl_recipes_translate():
    """verl's recipes (GSPO 30B, fully async) set the CPU optimizer beside megatron.optimizer_offload;
    here the CPU optimizer subsumes the offload, and its other switches are what it always runs with."""
    recipe = ["model.dtype=bf16", "actor.optim.use_distributed_optimizer=true",
              "actor_rollout_ref.actor.megatron.optimizer_offload=True",
              "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction=0.5",
              "+actor_rollout_ref.actor.optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d=True",
              "+actor_rollout_ref.actor.optim.override_optimizer_config.use_precision_aware_optimizer=True",
              "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=True"]
    outcomes = {o.key.rsplit(".", 1)[-1]: o for o in resolve(recipe)}
    assert outcomes["optimizer_offload"].ours == ("actor.offload.optimizer=false",)
    assert outcomes["overlap_cpu_optimizer_d2h_h2d"].action == "ignored"
    cfg = _cfg(*recipe)
    assert (cfg.actor.optim.cpu_offload, cfg.actor.optim.cpu_offload_fraction, cfg.actor.offload.optimizer) == (True, 0.5, False)
    assert not _cfg(*recipe[:3], "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=False"
                    ).actor.optim.cpu_offload
    assert _cfg(*recipe[:3]).actor.offload.optimizer  # without the CPU optimizer the offload stays


def test_context_parallel_translates_and_is_refused_until_built():
    """verl's context_parallel_size keeps its translation; cp > 1 is then refused naming our key, cp 1 runs."""
    for verl, ours in (("actor_rollout_ref.actor.megatron.context_parallel_size", "actor.parallel.cp"),
                       ("actor_rollout_ref.ref.megatron.context_parallel_size", "ref.parallel.cp")):
        assert _cfg(f"{verl}=1") == _cfg()
        with pytest.raises(ConfigError) as err:
            _cfg(f"{verl}=2")
        assert err.value.key == ours and "not built yet" in str(err.value) and len(str(err.value).splitlines()) == 1


# (override, words the message must hold: what to do instead)
REFUSED = [
    (["algorithm.adv_estimator=gae"], "grpo"),
    (["reward_model.enable=True"], "reward.custom_fn"),
    (["algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.kl_coef=0.001"], "actor.use_kl_loss"),
    (["reward_model.reward_manager=prime"], "reward.custom_fn"),
    (["actor_rollout_ref.actor.strategy=deepspeed"], "megatron"),
    (["actor_rollout_ref.model.override_config.rope_scaling=linear"], "config.json"),
    (["actor_rollout_ref.actor.use_fancy_thing=true"], "no dapo-megatron equivalent"),
    (["+actor_rollout_ref.actor.megatron.override_transformer_config.fp8=e4m3"], "bf16"),
    (["+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=3"],
     "actor.parallel.pp"),
    (["algorithm.rollout_correction.rollout_rs=seq_max_k1"], "actor.rollout_correction.rs"),
    (["algorithm.rollout_correction.rollout_is_batch_normalize=True"], "actor.rollout_correction"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=flow_grpo"], "actor.policy_loss"),  # verl's, for diffusion
    (["algorithm.rollout_correction.loss_type=gpg", "algorithm.rollout_correction.bypass_mode=True"],
     "ppo_clip or reinforce"),
    (["actor_rollout_ref.model.lora_rank=8"], "LoRA"),
    (["+reward_model.reward_kwargs.format_score=0.1"], "no dapo-megatron equivalent"),
    (["actor_rollout_ref.actor.megatron.dtype=int8"], "bfloat16"),
    (["actor_rollout_ref.actor.megatron.router_replay.mode=R4"], "actor.router_replay"),
    (["actor_rollout_ref.rollout.multi_turn.tool_config_path=tools.yaml"], "rollout.tools"),
    (["++transfer_queue.enable=False"], "data plane"),
    (["+trainer.v1.trainer_mode=colocate_async"], "trainer.placement=split"),
    (["+trainer.v1.sampler.max_off_policy_threshold=-1"], "policy versions >= 0"),
    (["+trainer.v1.sampler.max_off_policy_threshold=1.5"], "whole number"),
    (["+trainer.v1.sampler.max_off_policy_strategy=keep"], "drop or wait"),
    (["+trainer.v1.separate_async.parameter_sync_step=2"], "data.train_batch_size = parameter_sync_step x"),
    (["+trainer.v1.separate_async.parameter_sync_step=4", "data.train_batch_size=32",
      "actor_rollout_ref.actor.ppo_mini_batch_size=16"], "(got 32 and 16)"),
    (["+async_training.partial_rollout=False", "+async_training.staleness_threshold=0.5"], "partial_rollout=True"),
    (["+async_training.staleness_threshold=-1"], "share >= 0"),
    (["+async_training.require_batches=0"], "whole number >= 1"),
    (["+async_training.max_stale_tokens=3"], "config/verl_fully_async.py"),
    (["+rollout.nnodes=1", "+rollout.n_gpus_per_node=4", "trainer.nnodes=2"], "same devices per node"),
    (["algorithm.filter_groups.max_inflight_gen_batches=2"], "trainer.max_staleness"),
]


@pytest.mark.parametrize("overrides,instead", REFUSED, ids=[r[0][0] for r in REFUSED])
def test_refused_says_what_to_do_instead(overrides, instead):
    with pytest.raises(ConfigError) as err:
        _cfg(*overrides)
    assert err.value.key == overrides[0].lstrip("+").split("=")[0] and instead in str(err.value), str(err.value)


def test_fully_async_pools_are_one_device_count_here():
    """verl's trainer and rollouter pools -> our nodes x devices, the engines' share named."""
    def ours(*overrides):
        return {x for o in resolve(list(overrides)) for x in o.ours}
    # pools on nodes of their own (the 30B recipe: 2 + 2 nodes of 8)
    assert {"trainer.nnodes=4", "trainer.n_gpus_per_node=8", "rollout.num_devices=16"} <= ours(
        "trainer.nnodes=2", "trainer.n_gpus_per_node=8", "+rollout.nnodes=2", "+rollout.n_gpus_per_node=8")
    # each node split between the pools (verl's 4_12 recipe: 6 + 2 on each of 2 nodes)
    assert {"trainer.nnodes=2", "trainer.n_gpus_per_node=8", "rollout.num_devices=4"} <= ours(
        "trainer.nnodes=2", "trainer.n_gpus_per_node=6", "+rollout.nnodes=2", "+rollout.n_gpus_per_node=2")


def test_every_table_entry_targets_a_real_key_or_is_verl_only():
    known = schema_keys()
    assert not [ours for ours in RENAMES.values() if ours not in known]
    assert not [k for k in FIXED_VALUES if k in known and k != "algorithm.adv_estimator"]


def _keys_md() -> list[str]:
    """The key column of tests/data/verl/KEYS.md: every key of 40 verl DAPO scripts and docs."""
    import re
    from pathlib import Path
    text = (Path(__file__).parents[1] / "data" / "verl" / "KEYS.md").read_text()
    keys = {m.group(1) for m in re.finditer(r"^\| `([a-z_]+(?:\.[A-Za-z0-9_]+)+)`", text, re.M)}
    assert len(keys) > 200, len(keys)
    return sorted(keys)


def test_every_key_of_the_recipe_scripts_has_a_rule():
    """No key of verl's DAPO scripts falls through to the generic refusal: each one is ours or in a
    table (translated, accepted, ignored, or refused with its own reason)."""
    from dapo_megatron.config.load import schema_keys
    known = schema_keys()
    unruled = [k for k in _keys_md() if k not in known
               and "has no dapo-megatron equivalent" in (resolve([f"{k}=1"])[0].reason or "")]
    assert not unruled, unruled
