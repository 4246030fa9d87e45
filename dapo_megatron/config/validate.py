"""Every cross-field rule of the configuration, checked once at the entry point.

Each rule raises `ConfigError(key, message)` whose message names the key to change. Rules that
need the model's shape (heads, layers, experts) take its `ModelSpec` and run once the model is
known (`check_model`). The parallel-layout rules also serve the convert CLI, whose keys are its
flags (`--tp`): inner modules only assert what was checked here.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Optional

from dapo_megatron.algo import (IS_LEVELS, IS_MODES, KL_KINDS, LOSS_AGG_MODES, ON_EXHAUSTED, POLICY_LOSSES, RS_CRITERIA,
                                Correction)
from dapo_megatron.config.errors import ConfigError
from dapo_megatron.config.schema import DapoConfig, ParallelConfig, RewardConfig
from dapo_megatron.device import get_device
from dapo_megatron.dtypes import DTYPES
from dapo_megatron.models.spec import ModelSpec
from dapo_megatron.toolcall_formats import FORMATS
from dapo_megatron.dataplane import BACKENDS
from dapo_megatron.weights.transport import TRANSPORTS

KeyFn = Callable[[str], str]  # a degree's name ("tp") -> the key a user changes ("actor.parallel.tp", "--tp")

# Closed vocabularies, written once: key -> allowed values.
CHOICES: dict[str, tuple] = {
    "trainer.device": ("auto", "cuda", "npu", "cpu"),
    "trainer.placement": ("colocated", "split"),
    "trainer.layout": ("auto", "lean", "full"),
    "trainer.mode": ("sync", "one_step_off", "async"),
    "trainer.stale_strategy": ("drop", "wait"),
    "rollout.admission": ("groups", "responses"),
    "actor.loss_agg_mode": tuple(LOSS_AGG_MODES),
    "actor.policy_loss": tuple(POLICY_LOSSES),
    "actor.rollout_correction.is_level": (None, "none", "auto", *IS_LEVELS),
    "actor.rollout_correction.is_mode": IS_MODES,
    "actor.rollout_correction.rs": (None, *RS_CRITERIA),
    "actor.kl_loss_type": tuple(KL_KINDS),
    "actor.optim.lr_scheduler": ("constant", "cosine", "linear"),
    "actor.recompute_granularity": ("", "full", "selective"),
    "actor.router_replay": ("off", "actor", "rollout"),
    "actor.old_logprobs": ("auto", "recompute", "rollout"),
    "model.dtype": tuple(DTYPES),
    "data.truncation": ("filter", "left", "right", "error"),
    "algorithm.adv_estimator": ("grpo",),
    "algorithm.filter_groups.metric": ("acc", "score", "seq_reward", "seq_final_reward"),
    "algorithm.filter_groups.mode": ("sync", "early_stop"),
    "algorithm.filter_groups.on_exhausted": tuple(ON_EXHAUSTED),
    "rollout.name": ("vllm",),
    "rollout.sync.transport": tuple(TRANSPORTS),
    "rollout.sleep_level": (1, 2),
    "rollout.multi_turn.format": tuple(FORMATS),
    "data_plane.backend": BACKENDS,
}
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
# vLLM EngineArgs the engine sets itself -> the key that sets them (or why nobody may).
ENGINE_ARGS_OWNED = {
    "model": "model.path", "dtype": "model.dtype", "seed": "rollout.seed", "max_model_len":
    "data.max_prompt_length + data.max_response_length", "tensor_parallel_size": "rollout.parallel.tp",
    "enable_expert_parallel": "rollout.parallel.ep", "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "max_num_batched_tokens": "rollout.max_num_batched_tokens", "max_num_seqs": "rollout.max_concurrent_per_engine",
    "enforce_eager": "rollout.enforce_eager", "enable_prefix_caching": "rollout.enable_prefix_caching",
    "skip_tokenizer_init": "the driver (it tokenizes)", "logprobs_mode": "the trainer (processed log-probs)",
    "worker_extension_cls": "the weight sync", "enable_sleep_mode": "the device layer",
    "distributed_executor_backend": "the engine actor",
    "limit_mm_per_prompt": "rollout.max_images_per_prompt (vision-language models; no videos)"}


def engine_arg_keys(message: str) -> list[str]:
    """The config keys behind the vLLM arguments `message` names (an engine's start-up error), from
    ENGINE_ARGS_OWNED (not `model`, `dtype`, `seed`: words of any message)."""
    return [key for arg, key in ENGINE_ARGS_OWNED.items()
            if "_" in arg and "." in key and re.search(rf"\b{re.escape(arg)}\b", message)]


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def _check_choices(cfg: DapoConfig) -> None:
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        _require(value in allowed, key, f"{key}={value!r} is not one of {', '.join(map(repr, allowed))}")
    for name in cfg.trainer.logger:
        _require(name in LOGGERS, "trainer.logger", f"trainer.logger entry {name!r} is not one of {LOGGERS}")
    for name in cfg.rollout.engine_kwargs:
        _require(name not in ENGINE_ARGS_OWNED, f"rollout.engine_kwargs.{name}",
                 f"rollout.engine_kwargs.{name} is set by {ENGINE_ARGS_OWNED.get(name)}; remove it")
    mode = cfg.trainer.resume_mode
    _require(bool(mode), "trainer.resume_mode", "trainer.resume_mode must be auto, disable or a checkpoint path")


def _check_positive(cfg: DapoConfig) -> None:
    for key in ("data.max_prompt_length", "data.max_response_length", "data.train_batch_size",
                "data.gen_batch_size", "rollout.n", "actor.ppo_mini_batch_size", "actor.ppo_epochs",
                "actor.max_tokens_per_microbatch", "trainer.nnodes", "trainer.n_gpus_per_node",
                "trainer.total_epochs", "rollout.max_concurrent_per_engine", "rollout.max_images_per_prompt",
                "rollout.sync.bucket_mb", "data_plane.storage_units"):
        value = _get(cfg, key)
        _require(value > 0, key, f"{key} must be positive, got {value}")
    steps = cfg.trainer.total_training_steps
    _require(steps is None or steps > 0, "trainer.total_training_steps",
             f"trainer.total_training_steps must be positive or null, got {steps}")
    _require(cfg.reward.timeout_s > 0, "reward.timeout_s", "reward.timeout_s must be positive")
    _require(cfg.trainer.max_restarts >= 0, "trainer.max_restarts",
             f"trainer.max_restarts must be >= 0 (0: a dead role stops the run), got {cfg.trainer.max_restarts}")
    _require(cfg.trainer.placement_timeout_s >= 0, "trainer.placement_timeout_s",
             f"trainer.placement_timeout_s must be >= 0 seconds (0: no limit), got {cfg.trainer.placement_timeout_s}")
    _require(cfg.rollout.max_engine_restarts >= 0, "rollout.max_engine_restarts",
             f"rollout.max_engine_restarts must be >= 0 (0: a dead engine stops the run), "
             f"got {cfg.rollout.max_engine_restarts}")
    _require(cfg.rollout.engine_timeout_s >= 0, "rollout.engine_timeout_s",
             f"rollout.engine_timeout_s must be >= 0 seconds (0: no limit), got {cfg.rollout.engine_timeout_s}")
    _require(cfg.data_plane.capacity >= 0, "data_plane.capacity",
             f"data_plane.capacity must be 0 (unlimited) or a number of samples, got {cfg.data_plane.capacity}")
    if cfg.rollout.multi_turn.enable:
        for key in ("rollout.multi_turn.max_turns", "rollout.multi_turn.tool_timeout_s",
                    "rollout.multi_turn.tool_pool", "rollout.multi_turn.max_tool_output_chars"):
            value = _get(cfg, key)
            _require(value > 0, key, f"{key} must be positive, got {value}")
        _require(bool(cfg.rollout.tools), "rollout.tools",
                 "rollout.multi_turn.enable=true needs at least one tool in rollout.tools (e.g. [python])")
        # The engine's routes cover one request; a multi-turn response is several.
        _require(cfg.actor.router_replay != "rollout", "actor.router_replay",
                 "actor.router_replay=rollout does not run with rollout.multi_turn.enable=true: set "
                 "actor.router_replay=actor (routes recorded by the old-log-prob pass)")
        # A turn ends at its stop token; without one every turn runs to the token budget.
        _require(not cfg.rollout.ignore_eos, "rollout.ignore_eos",
                 "rollout.ignore_eos=true does not run with rollout.multi_turn.enable=true (turns end at their "
                 "end-of-turn token); set rollout.ignore_eos=false")
    if cfg.reward.overlong_buffer.enable:
        buf = cfg.reward.overlong_buffer.len
        _require(0 < buf <= cfg.data.max_response_length, "reward.overlong_buffer.len",
                 f"reward.overlong_buffer.len ({buf}) must be in (0, data.max_response_length="
                 f"{cfg.data.max_response_length}]")


def check_reward(r: RewardConfig) -> None:
    """The reward backend is one of custom_fn, service_url, the local pool (RewardManager checks
    this too, for managers built without a DapoConfig)."""
    _require(not (r.custom_fn and r.service_url), "reward.service_url",
             "reward.custom_fn and reward.service_url are exclusive: the service runs the built-in math reward; "
             "unset one of them")


def _check_algorithm(cfg: DapoConfig) -> None:
    a = cfg.actor
    _require(0.0 <= a.clip_ratio_low < 1.0, "actor.clip_ratio_low",
             f"actor.clip_ratio_low must be in [0, 1), got {a.clip_ratio_low}")
    _require(a.clip_ratio_high >= 0.0, "actor.clip_ratio_high",
             f"actor.clip_ratio_high must be >= 0, got {a.clip_ratio_high}")
    _require(a.clip_ratio_c is None or a.clip_ratio_c > 1.0, "actor.clip_ratio_c",
             f"actor.clip_ratio_c must be > 1 (or null to turn dual clip off), got {a.clip_ratio_c}")
    needs = POLICY_LOSSES[a.policy_loss].agg
    _require(needs is None or a.loss_agg_mode == needs, "actor.loss_agg_mode",
             f"actor.policy_loss={a.policy_loss} is a sequence-level objective: set actor.loss_agg_mode={needs} "
             f"(got {a.loss_agg_mode})" + (", or actor.policy_loss=gspo_token for its token form"
                                           if a.policy_loss == "gspo" else ""))
    _check_loss_params(a)
    _check_correction(a.rollout_correction)
    if a.old_logprobs == "rollout":
        _check_bypass(a)
    d = cfg.data
    _require(d.gen_batch_size >= d.train_batch_size, "data.gen_batch_size",
             f"data.gen_batch_size ({d.gen_batch_size}) must be >= data.train_batch_size ({d.train_batch_size})")
    _require(d.train_batch_size % a.ppo_mini_batch_size == 0, "actor.ppo_mini_batch_size",
             f"actor.ppo_mini_batch_size ({a.ppo_mini_batch_size}) must divide data.train_batch_size "
             f"({d.train_batch_size})")


def _correction_level(cfg: DapoConfig) -> Optional[str]:
    """actor.rollout_correction.is_level resolved: `auto` is token-level truncated weights whenever a
    trained token can come from older weights than the proximal policy's (one_step_off, async, a
    streamed mini-batch after the step's first optimizer step), none in sync mode, where the engine
    holds the trained weights; `none` is null."""
    level = cfg.actor.rollout_correction.is_level
    if level == "auto":  # with actor.old_logprobs=rollout, pi_old is pi_rollout: nothing to weigh
        off_policy = cfg.trainer.mode != "sync" or cfg.trainer.parts(cfg.data.train_batch_size,
                                                                     cfg.actor.ppo_mini_batch_size) > 1
        return "token" if off_policy and cfg.actor.old_logprobs != "rollout" else None
    return None if level == "none" else level


def _check_bypass(a) -> None:
    """actor.old_logprobs=rollout (verl's bypass mode): no correction on top of a ratio to pi_rollout
    (REINFORCE has none: its weight is the correction), no pass to record routes in."""
    c, k = a.rollout_correction, "actor.rollout_correction."
    for name in ("is_level", "rs", "veto_threshold"):
        _require(getattr(c, name) is None or POLICY_LOSSES[a.policy_loss].weighs_current, k + name,
                 f"actor.old_logprobs=rollout makes the engine's log-probs pi_old: the ratio pi / pi_rollout is "
                 f"already the correction (verl's bypass mode applies no weights with ppo_clip); unset {k}{name}")
    _require(a.router_replay != "actor", "actor.router_replay",
             "actor.router_replay=actor records the routes in the old-log-prob pass, which "
             "actor.old_logprobs=rollout does not run: use actor.router_replay=rollout (the engine's routes)")


def _check_loss_params(a) -> None:
    """The keys of the loss rows that read their own (actor.policy_loss_params)."""
    p, k = a.policy_loss_params, "actor.policy_loss_params."
    _require(a.policy_loss != "dro" or (p.dro_beta is not None and p.dro_beta > 0), k + "dro_beta",
             f"actor.policy_loss=dro needs {k}dro_beta > 0 (the quadratic log-ratio penalty), got {p.dro_beta}")
    for name in ("tau_pos", "tau_neg", "clip_cov_ratio", "kl_cov_ratio"):
        _require(getattr(p, name) > 0, k + name, f"{k}{name} must be > 0, got {getattr(p, name)}")
    _require(p.clip_cov_lb < p.clip_cov_ub, k + "clip_cov_lb",
             f"{k}clip_cov_lb ({p.clip_cov_lb}) must be below clip_cov_ub ({p.clip_cov_ub})")
    _require(p.ppo_kl_coef >= 0, k + "ppo_kl_coef", f"{k}ppo_kl_coef must be >= 0, got {p.ppo_kl_coef}")


def _check_correction(c) -> None:
    k = "actor.rollout_correction."
    for name in ("is_threshold", "is_threshold_lower", "rs_threshold", "rs_threshold_lower", "veto_threshold"):
        value = getattr(c, name)
        _require(value is None or value > 0, k + name, f"{k}{name} must be > 0 or null, got {value}")
    c = Correction(**vars(c))  # its defaults for the lower bounds
    _require(c.is_mode != "mask" or c.is_lower < c.is_threshold, k + "is_threshold_lower",
             f"{k}is_threshold_lower ({c.is_lower}) must be below {k}is_threshold ({c.is_threshold})")
    if c.rs is not None:
        _require(c.rs_threshold is not None, k + "rs_threshold", f"{k}rs={c.rs} needs {k}rs_threshold")
        _require(not c.rs.endswith("k1") or c.rs_lower < c.rs_threshold, k + "rs_threshold_lower",
                 f"{k}rs_threshold_lower ({c.rs_lower}) must be below {k}rs_threshold ({c.rs_threshold}): a k1 "
                 f"criterion bounds the ratio from both sides")


def role_devices(cfg: DapoConfig) -> dict[str, int]:
    """Devices of each role: colocated roles share all of them, split gives the engines their own."""
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if cfg.trainer.placement == "colocated":
        return {"actor": world, "ref": world, "rollout": world}
    n = cfg.rollout.num_devices
    _require(0 < n < world, "rollout.num_devices",
             f"with trainer.placement=split, rollout.num_devices ({n}) must be in (0, {world}): the engines "
             f"take that many of the trainer.nnodes x trainer.n_gpus_per_node devices, training the rest")
    return {"actor": world - n, "ref": world - n, "rollout": n}


def num_engines(cfg: DapoConfig) -> int:
    return cfg.rollout.num_engines or role_devices(cfg)["rollout"] // cfg.rollout.parallel.tp


def data_parallel_size(p: ParallelConfig, devices: int) -> int:
    return devices // (p.tp * p.pp * p.cp)


def _role_key(role: str) -> KeyFn:
    return lambda name: f"{role}.parallel.{name}"


def check_parallel(p: ParallelConfig, devices: int, key: KeyFn, what: str = "ranks") -> None:
    """Degrees >= 1 that fit `devices`: TP x PP x CP (dense) and EP x ETP x PP (experts) divide it."""
    for name in ("tp", "pp", "vpp", "ep", "etp", "cp"):
        _require(getattr(p, name) >= 1, key(name), f"{key(name)} must be >= 1, got {getattr(p, name)}")
    model = p.tp * p.pp * p.cp
    _require(devices % model == 0, key("tp"),
             f"{key('tp')} ({p.tp}) x {key('pp')} ({p.pp}) x {key('cp')} ({p.cp}) = {model} must divide the "
             f"{devices} {what}")
    expert = p.ep * p.etp * p.pp
    _require(devices % expert == 0, key("ep"),
             f"{key('ep')} ({p.ep}) x {key('etp')} ({p.etp}) x {key('pp')} ({p.pp}) = {expert} must divide the "
             f"{devices} {what}; change {key('ep')} or {key('etp')}")
    _require(p.vpp == 1 or p.pp > 1, key("vpp"), f"{key('vpp')} ({p.vpp}) needs {key('pp')} > 1")


def check_parallel_fits_model(p: ParallelConfig, spec: ModelSpec, key: KeyFn, *, trains: bool = True) -> None:
    """A Megatron layout over this model: TP over the heads, PP x VPP over the layers, EP over the
    experts; for training, the expert-TP rule below."""
    heads, kv = spec.num_heads, spec.num_kv_heads
    _require(heads % p.tp == 0 and kv % p.tp == 0, key("tp"),
             f"{key('tp')} ({p.tp}) must divide the model's attention heads ({heads}) and key-value heads ({kv})")
    _require(spec.num_layers % (p.pp * p.vpp) == 0, key("pp"),
             f"{key('pp')} ({p.pp}) x {key('vpp')} ({p.vpp}) must divide the model's {spec.num_layers} layers")
    _require(p.ep == 1 or (spec.num_experts and spec.num_experts % p.ep == 0), key("ep"),
             f"{key('ep')} ({p.ep}) must divide the model's number of experts ({spec.num_experts})")
    # megatron-core 0.16.1 reduces expert grads over the dense DP group only: with TP>1 and
    # EP=1 each TP rank would keep half the expert gradient unless experts are TP-split too.
    _require(not trains or not spec.is_moe or p.tp == 1 or p.ep > 1 or p.etp == p.tp, key("etp"),
             f"{key('etp')} ({p.etp}) must equal {key('tp')} ({p.tp}) to train an MoE model with {key('ep')}=1 "
             f"(megatron-core mis-reduces expert gradients otherwise); or raise {key('ep')}")


def _check_layouts(cfg: DapoConfig) -> None:
    devices = role_devices(cfg)
    # verl's context_parallel_size translates to these. Once built, routing replay must still refuse
    # it (routes are laid out per sequence position, context parallelism reorders them).
    for role in ("actor", "ref"):
        cp = getattr(cfg, role).parallel.cp
        _require(cp <= 1, f"{role}.parallel.cp", f"{role}.parallel.cp={cp}: context parallelism is not built yet "
                 f"(the log-prob and micro-batch code has no sequence split); set {role}.parallel.cp=1")
    check_parallel(cfg.actor.parallel, devices["actor"], _role_key("actor"), "devices of the actor")
    if cfg.actor.use_kl_loss:
        check_parallel(cfg.ref.parallel, devices["ref"], _role_key("ref"), "devices of the reference")
        # The reference runs on the actor's ranks, inside the same Megatron parallel state.
        _require(cfg.ref.parallel == cfg.actor.parallel, "ref.parallel",
                 f"ref.parallel ({cfg.ref.parallel}) must equal actor.parallel ({cfg.actor.parallel}): the "
                 f"reference shares the actor's ranks")
    r = cfg.rollout.parallel
    _require(r.tp >= 1 and devices["rollout"] % r.tp == 0, "rollout.parallel.tp",
             f"rollout.parallel.tp ({r.tp}) must divide the {devices['rollout']} devices of the engines")
    _require(r.ep in (1, r.tp), "rollout.parallel.ep",
             f"rollout.parallel.ep ({r.ep}) must be 1 or equal rollout.parallel.tp ({r.tp}): vLLM spreads "
             f"experts over the engine's tensor-parallel ranks")
    for name in ("pp", "vpp", "cp", "etp"):
        _require(getattr(r, name) == 1, f"rollout.parallel.{name}",
                 f"rollout.parallel.{name} must be 1 (an engine uses TP, and EP over the same ranks)")
    _require(not r.sequence_parallel, "rollout.parallel.sequence_parallel",
             "rollout.parallel.sequence_parallel=true is a training layout's switch (actor.parallel."
             "sequence_parallel); an engine has none: set it false")
    fit = devices["rollout"] // r.tp
    _require(0 <= cfg.rollout.num_engines <= fit, "rollout.num_engines",
             f"rollout.num_engines ({cfg.rollout.num_engines}) must be in [0, {fit}]: {devices['rollout']} engine "
             f"devices / rollout.parallel.tp ({r.tp}); 0 starts {fit}")
    _require(0 < cfg.rollout.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization",
             f"rollout.gpu_memory_utilization must be in (0, 1], got {cfg.rollout.gpu_memory_utilization}")
    _check_mode(cfg)
    _check_offload(cfg)
    _check_cpu_optimizer(cfg)
    dp = data_parallel_size(cfg.actor.parallel, devices["actor"])
    responses = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    _require(responses % dp == 0, "actor.ppo_mini_batch_size",
             f"actor.ppo_mini_batch_size ({cfg.actor.ppo_mini_batch_size}) x rollout.n ({cfg.rollout.n}) = "
             f"{responses} responses must split evenly over the actor's {dp} data-parallel ranks")


def _check_mode(cfg: DapoConfig) -> None:
    """one_step_off and async generate while the actor trains: on devices of their own. Colocated,
    the engines sleep and the actor's state is offloaded in turns (verl's colocate_async is not built)."""
    _require(cfg.trainer.mode == "sync" or cfg.trainer.placement == "split", "trainer.placement",
             f"trainer.mode={cfg.trainer.mode} generates while the actor trains: it needs trainer.placement=split "
             "(engines on rollout.num_devices devices of their own)")
    t = cfg.trainer
    _require(t.max_staleness >= 1, "trainer.max_staleness",
             f"trainer.max_staleness={t.max_staleness} must be >= 1 (policy versions a trained token may lag)")
    _require(t.mode == "async" or t.max_staleness == 1, "trainer.max_staleness",
             f"trainer.max_staleness={t.max_staleness} bounds trainer.mode=async; trainer.mode={t.mode} lags "
             f"{t.batches_ahead}: set trainer.mode=async or leave trainer.max_staleness at 1")
    _require(t.stale_strategy == "drop" or t.carries_in_flight, "trainer.stale_strategy",
             f"trainer.stale_strategy={t.stale_strategy} acts on groups carried across batches: it needs "
             "trainer.mode=async with trainer.partial_rollout=true (otherwise none is carried)")
    # Beyond one push of lag the bound would hold a batch asked two steps ahead for a push that comes
    # after a validation queued behind it (the manager's calls run in order): a share < 1 of one
    # push's lag is verl's staleness_threshold; whole steps of lag are max_staleness.
    _require(t.stale_share is None or (0 <= t.stale_share < 1 and t.carries_in_flight and t.max_staleness == 1),
             "trainer.stale_share",
             f"trainer.stale_share={t.stale_share} bounds the share of a batch's groups started before its last "
             "push: it needs trainer.mode=async with trainer.partial_rollout=true and trainer.max_staleness=1, and "
             "a share in [0, 1) (null: no bound; more lag: trainer.max_staleness)")
    if t.stream_minibatches:  # a mini-batch trains while the engines generate the step's others
        _require(t.placement == "split", "trainer.stream_minibatches",
                 "trainer.stream_minibatches trains while the engines generate: it needs trainer.placement=split "
                 "(colocated, the engines sleep while the actor trains)")
        _require(cfg.actor.ppo_epochs == 1, "trainer.stream_minibatches",
                 f"trainer.stream_minibatches trains each mini-batch once, as it arrives; actor.ppo_epochs="
                 f"{cfg.actor.ppo_epochs} would go over the whole batch again: set actor.ppo_epochs=1")
        _require(not (t.carries_in_flight and t.stale_strategy == "wait"), "trainer.stream_minibatches",
                 "trainer.stale_strategy=wait puts the oldest groups first once the batch is full, after "
                 "streamed mini-batches have trained: use trainer.stale_strategy=drop")
    _check_segments(cfg)
    # async streams prompts to the engines; recipe rounds would wait for each round's tail
    _require(t.mode != "async" or cfg.algorithm.filter_groups.mode == "early_stop", "algorithm.filter_groups.mode",
             "trainer.mode=async streams prompts (early-stop dynamic sampling): set "
             "algorithm.filter_groups.mode=early_stop")


def _check_segments(cfg: DapoConfig) -> None:
    """trainer.deterministic with async partial rollouts: waves whose responses wait for each push
    at a segment's end (rollout/features.py's `Segments`). What acts on carried groups, or makes
    which groups reach an engine before a push a matter of timing, does not apply there."""
    t = cfg.trainer
    on = t.deterministic and t.carries_in_flight
    _require(t.segment_tokens is None or (on and t.segment_tokens > 0), "trainer.segment_tokens",
             f"trainer.segment_tokens={t.segment_tokens} is the tokens per push of a deterministic run's partial "
             "rollouts: it needs trainer.deterministic=true, trainer.mode=async, trainer.partial_rollout=true and a "
             "value > 0 (null: data.max_response_length // (max_staleness + 1))")
    if not on:
        return
    why = "trainer.deterministic with partial rollouts generates in waves held at each push"
    _require(t.max_staleness == 1 or t.test_freq <= 0, "trainer.max_staleness",
             f"{why}: trainer.max_staleness={t.max_staleness} would hold a batch for a push that comes after a "
             "validation queued behind it; set trainer.max_staleness=1 or trainer.test_freq=0")
    for key, value, off in (("trainer.stale_share", t.stale_share, None), ("trainer.stale_strategy", t.stale_strategy, "drop"),
                            ("trainer.stream_minibatches", t.stream_minibatches, False),
                            ("rollout.multi_turn.enable", cfg.rollout.multi_turn.enable, False),
                            ("rollout.admission", cfg.rollout.admission, "groups")):
        shown = "null" if off is None else str(off).lower()
        _require(value == off, key, f"{why}: {key}={value} does not apply there; set {key}={shown}")


def _check_offload(cfg: DapoConfig) -> None:
    """Offload frees the actor's devices for the engines; in split placement no engine shares
    them, so it would only add two copies per step. (Every device kind can offload: on a CPU the
    host copies are real and the code path runs, though nothing changes place.)"""
    if cfg.trainer.placement == "colocated":
        return
    on = [f"actor.offload.{name}" for name, flag in vars(cfg.actor.offload).items() if flag]
    _require(not on, on[0] if on else "", f"{', '.join(on)} need trainer.placement=colocated: in split placement no "
             f"engine shares the actor's devices; set {'=false, '.join(on)}=false")


def _check_cpu_optimizer(cfg: DapoConfig) -> None:
    """The CPU optimizer keeps its share of the optimizer on the host the whole run; the state that
    actor.offload.optimizer would move is then the rest, whose tensors Megatron's hybrid optimizer
    shares with the parameters' buffer (precision-aware): one of the two, not both."""
    o = cfg.actor.optim
    _require(0 < o.cpu_offload_fraction <= 1, "actor.optim.cpu_offload_fraction",
             f"actor.optim.cpu_offload_fraction must be in (0, 1], got {o.cpu_offload_fraction}")
    if not o.cpu_offload:
        return
    _require(o.use_distributed_optimizer, "actor.optim.cpu_offload",
             "actor.optim.cpu_offload=true needs actor.optim.use_distributed_optimizer=true (Megatron's "
             "precision-aware optimizer, which puts the fp32 masters on the host, is distributed only)")
    _require(cfg.model.dtype != "fp32", "actor.optim.cpu_offload",
             "actor.optim.cpu_offload=true needs model.dtype=bf16 or fp16: Megatron's CPU optimizer steps "
             "fp32 copies of 16-bit weights (on fp32 ones it fails: \"can't optimize a non-leaf Tensor\")")
    _require(not cfg.actor.offload.optimizer, "actor.offload.optimizer",
             "actor.offload.optimizer=true moves the optimizer to host memory while the engines generate; "
             "actor.optim.cpu_offload=true keeps it there all the time: set actor.offload.optimizer=false "
             "(or actor.optim.cpu_offload=false)")


def check_model(cfg: DapoConfig, spec: ModelSpec) -> None:
    """Rules that need the model's shape; run once, where the model is first known."""
    roles = [("actor", cfg.actor.parallel)] + ([("ref", cfg.ref.parallel)] if cfg.actor.use_kl_loss else [])
    for role, p in roles:
        check_parallel_fits_model(p, spec, _role_key(role))
    r = cfg.rollout.parallel
    heads, kv, experts = spec.num_heads, spec.num_kv_heads, spec.num_experts
    _require(r.ep == 1 or (experts and experts % r.ep == 0), "rollout.parallel.ep",
             f"rollout.parallel.ep ({r.ep}) must divide the model's number of experts ({experts})")
    engine = get_device(cfg.trainer.device)
    _require(r.ep == 1 or engine.engine_expert_parallel, "rollout.parallel.ep",
             f"rollout.parallel.ep ({r.ep}) > 1 does not run on {engine.vllm_package} (its fused-MoE kernel crashes "
             f"on expert-parallel engines); set rollout.parallel.ep=1: the engine then splits every expert over "
             f"its rollout.parallel.tp ranks")
    _require(heads % r.tp == 0 and (kv % r.tp == 0 or r.tp % kv == 0), "rollout.parallel.tp",
             f"rollout.parallel.tp ({r.tp}) must divide the attention heads ({heads}) and divide or be a "
             f"multiple of the key-value heads ({kv})")
    _check_router_replay(cfg, spec, engine)
    _check_vision(cfg, spec, roles)
    check_lengths_fit(cfg, spec)


def check_lengths_fit(cfg: DapoConfig, spec: ModelSpec) -> None:
    """Prompt + response within the model's max_position_embeddings: the engines refuse a longer
    context (vLLM after a minute of start-up), unless the engines are told the model takes more
    (rollout.engine_kwargs.hf_overrides, as verl's model.override_config: RoPE has no table).
    Also `evaluate`'s rule for lengths a user set."""
    overridden = (cfg.rollout.engine_kwargs.get("hf_overrides") or {}).get("max_position_embeddings")
    max_pos = int(overridden) if overridden is not None else spec.max_position_embeddings
    total = cfg.data.max_prompt_length + cfg.data.max_response_length
    told = " (rollout.engine_kwargs.hf_overrides.max_position_embeddings)" if overridden is not None else ""
    _require(max_pos is None or total <= max_pos, "data.max_response_length",
             f"data.max_prompt_length + data.max_response_length = {total} exceeds the model's "
             f"max_position_embeddings ({max_pos}){told}")


def _check_vision(cfg: DapoConfig, spec: ModelSpec, roles: list) -> None:
    """A vision-language model's rules (the model builder enforces them too, after Ray started)."""
    if not spec.is_vision_language:
        return
    deep = spec.deepstack_layers
    for role, p in roles:
        first = spec.num_layers // (p.pp * p.vpp)
        _require(deep <= first, f"{role}.parallel.pp",
                 f"{spec.model_type} adds vision features (deepstack) to its first {deep} layers, which must be on "
                 f"the first pipeline stage; {role}.parallel.pp ({p.pp}) x vpp ({p.vpp}) leaves {first} there")
    # The tool loop (rollout/multiturn.py) runs text prompts only.
    _require(not cfg.rollout.multi_turn.enable, "rollout.multi_turn.enable",
             f"{spec.model_type} is a vision-language model; multi-turn rollouts take text prompts only: set "
             f"rollout.multi_turn.enable=false")
    # A fully recomputed layer re-adds the deepstack features in its checkpoint, and its backward
    # runs through the vision tower's graph twice (measured: "backward through the graph a second time").
    _require(not deep or cfg.actor.recompute_granularity != "full", "actor.recompute_granularity",
             f"{spec.model_type} (deepstack) does not train with actor.recompute_granularity=full; use selective")


def _check_router_replay(cfg: DapoConfig, spec: ModelSpec, engine) -> None:
    mode = cfg.actor.router_replay
    if mode == "off":
        return
    _require(spec.is_moe, "actor.router_replay",
             f"actor.router_replay={mode} needs an MoE model; {spec.model_type} has no router: set "
             f"actor.router_replay=off")
    if mode != "rollout":
        return
    _require(engine.engine_returns_routes, "actor.router_replay",
             f"actor.router_replay=rollout needs engines that return routed experts; {engine.vllm_package} cannot "
             f"(vLLM captures them in Model Runner V2, which needs Triton): set actor.router_replay=actor "
             f"(the update replays the old-log-prob pass's routes) or off")
    _require(cfg.rollout.enable_prefix_caching, "rollout.enable_prefix_caching",
             "actor.router_replay=rollout needs rollout.enable_prefix_caching=true (vLLM's routed-experts "
             "capture requires it)")


def validate(cfg: DapoConfig, spec: Optional[ModelSpec] = None) -> DapoConfig:
    _check_choices(cfg)
    cfg.actor.rollout_correction.is_level = _correction_level(cfg)  # the one value resolved here
    _check_positive(cfg)
    _check_algorithm(cfg)
    check_reward(cfg.reward)
    _check_layouts(cfg)
    if spec is not None:
        check_model(cfg, spec)
    return cfg
