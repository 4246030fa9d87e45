"""The typed configuration: one dataclass per group, defaults live here and nowhere else.

Names follow the DAPO recipe docs (`data.train_batch_size`, `actor.clip_ratio_high`, ...) so a
recipe command line carries over; `verl_compat.py` translates verl's longer paths to these.
Validation of cross-field rules lives in `validate.py`, not in `__post_init__`, so that every
rule reports the key to change in one consistent format.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class ParallelConfig:
    """Megatron / vLLM parallel degrees of one role (DP is derived from the device count). An
    engine uses tp, and ep over the same ranks; validation refuses the others there."""
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    vpp: int = 1  # virtual pipeline stages per pipeline rank (1: interleaving off)
    ep: int = 1  # expert parallel
    etp: int = 1  # expert tensor parallel
    cp: int = 1  # context parallel: only 1 (validate refuses more: no sequence split in log-probs / micro-batches)
    sequence_parallel: bool = False  # forced on by the model builder when TP>1 with MoE


@dataclass
class DataConfig:
    train_files: List[str] = field(default_factory=list)
    val_files: List[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 1024
    max_response_length: int = 2048
    train_batch_size: int = 512  # prompts (groups) kept per step
    gen_batch_size: int = 1536  # prompts sent to the engines per generation round
    truncation: str = "filter"  # filter | left | right | error  (prompts over max_prompt_length)
    skip_bad_rows: bool = False  # skip and count malformed rows instead of raising
    shuffle: bool = True
    seed: int = 1


@dataclass
class ModelConfig:
    path: str = ""  # HF checkpoint dir (config.json + safetensors)
    tokenizer_path: str = ""  # empty: same as path
    # A Megatron dist checkpoint (a run's step_<N> folder, or a converted model) whose weights the
    # actor and reference start from; not a resume (no optimizer, schedule or data position). The
    # engines still load model.path, and the first weight sync replaces it before any generation.
    load_checkpoint: str = ""
    dtype: str = "bf16"  # fp32 | bf16 | fp16 (parameters and compute)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = 10
    lr_scheduler: str = "constant"  # constant | cosine | linear
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = True
    # Megatron's CPU optimizer (HybridDeviceOptimizer): the fp32 masters and Adam's moments of this
    # fraction of the rank's shard live and step on the host for the whole run, the rest on the device
    # (verl's override_optimizer_config.optimizer_cpu_offload / optimizer_offload_fraction).
    cpu_offload: bool = False
    cpu_offload_fraction: float = 1.0


@dataclass
class OffloadConfig:
    """What the actor keeps in host memory while the engines generate (colocated placement only;
    verl's megatron.{param,grad,optimizer}_offload). Each moves back before the old-log-prob pass."""
    params: bool = False  # offloaded after the weight sync (the sync's TP / EP gathers need them)
    grads: bool = False  # main-grad buffers, freed after the update: dead until the next one zeroes them
    optimizer: bool = False  # Adam moments and fp32 master weights, after the update


@dataclass
class PolicyLossParams:
    """The keys of the loss rows that have their own (algo/loss.py `LossParams`; verl's names and
    defaults: actor.tau_pos / tau_neg, actor.policy_loss.* there)."""
    tau_pos: float = 1.0  # sapo: the soft gate's temperature where A > 0
    tau_neg: float = 1.05  # sapo: where A <= 0
    clip_cov_ratio: float = 0.0002  # clip_cov: share of the tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: the covariance band they are drawn from
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: share of the tokens given the |log r| term
    ppo_kl_coef: float = 0.1  # kl_cov: its coefficient
    dro_beta: Optional[float] = None  # dro: the quadratic log-ratio penalty (> 0, required there)


@dataclass
class RolloutCorrectionConfig:
    """Engine vs trainer mismatch, rho = pi_old / pi_rollout per token (algo/correction.py; verl's
    algorithm.rollout_correction). The one home of rollout correction."""
    # importance weights: token | sequence | geometric | none (null: none). auto: token where trained
    # tokens can be off-policy (trainer.mode one_step_off / async), none in sync mode; resolved once,
    # by config/validate.py, so a run's config.yaml records the level it trained with
    is_level: Optional[str] = "auto"
    is_mode: str = "truncate"  # truncate: weights clamped at is_threshold; mask: zero outside the band
    is_threshold: float = 2.0  # the weights' upper bound (truncate) or the band's top (mask)
    is_threshold_lower: Optional[float] = None  # mask: the band's bottom; null: 1 / is_threshold
    rs: Optional[str] = None  # rejection: token_k1 ... seq_max_k3 (aggregation_estimator); null: none
    rs_threshold: Optional[float] = None  # k1: the ratio's upper bound; k2 / k3: the divergence's
    rs_threshold_lower: Optional[float] = None  # k1: the ratio's lower bound; null: 1 / rs_threshold
    veto_threshold: Optional[float] = None  # drop a sequence with any rho below this; null: off


@dataclass
class ActorConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 32  # prompts per optimizer step (x rollout.n responses)
    ppo_epochs: int = 1
    max_tokens_per_microbatch: int = 16384  # dynamic batch size: micro-batches by token budget
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: Optional[float] = 10.0  # dual clip bound for negative advantages; null: off
    loss_agg_mode: str = "token-mean"
    # dapo | gspo, sapo, geo_mean (need seq-mean-token-mean) | gspo_token | cispo | reinforce | clip_cov |
    # kl_cov | gpg | dro | dppo_tv | dppo_kl: the rows of algo/loss.POLICY_LOSSES
    policy_loss: str = "dapo"
    policy_loss_params: PolicyLossParams = field(default_factory=PolicyLossParams)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # k1 | mse (k2) | low_var_kl (k3)
    recompute_granularity: str = ""  # "" | full | selective
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    # MoE routing replay (train/routing.py): off | actor (R2: the update replays the routes of
    # the old-log-prob pass) | rollout (R3: old log-probs and the update replay the engine's routes)
    router_replay: str = "off"
    # auto: when the update is exactly on-policy (one epoch over one mini-batch) the old log-probs
    # are its own forward, detached, and no separate pass runs; recompute: always the pass;
    # rollout: the engine's log-probs are pi_old (verl's bypass mode: two policies, no pass, the
    # clipped ratio pi / pi_rollout its only correction)
    old_logprobs: str = "auto"

    def reuses_update_forward(self, n: int, responses: int) -> bool:
        """Whether a step of `responses` (rollout.n = `n`) skips the old-log-prob pass: before the
        only optimizer step, the policy being trained is the proximal one, so ratio = 1 exactly."""
        return self.old_logprobs == "auto" and self.ppo_epochs == 1 and responses <= self.ppo_mini_batch_size * n

    def runs_old_logprob_pass(self, n: int, responses: int) -> bool:
        """Whether a step computes old log-probs in a pass of their own (not the engine's, not the
        update's own forward)."""
        return self.old_logprobs != "rollout" and not self.reuses_update_forward(n, responses)


@dataclass
class RefConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    offload: bool = True  # keep reference weights in host memory between uses


@dataclass
class SamplingKwargs:
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class SyncConfig:
    bucket_mb: int = 1024
    verify_every: int = 0  # checksum engines vs trainer every N syncs; 0: never (tests force 1)
    # object_store: buckets through Ray's object store (host memory). broadcast: one process
    # group per sending trainer rank with the engines (gloo on CPU, NCCL / HCCL on devices).
    transport: str = "object_store"


@dataclass
class MultiTurnConfig:
    """Multi-turn rollout with tool calls: a turn that calls tools continues after their messages."""
    enable: bool = False
    max_turns: int = 4  # model turns per response (a turn that still calls tools at the limit ends it)
    format: str = "hermes"  # tool-call format of the chat template (toolcall_formats.FORMATS)
    tool_timeout_s: float = 10.0  # wall clock per call; the interpreter's CPU limit too
    tool_pool: int = 8  # tool calls running at once per engine
    max_tool_output_chars: int = 4000  # the interpreter's output is cut there


@dataclass
class RolloutConfig:
    name: str = "vllm"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # per engine: tp and ep
    num_devices: int = 0  # split placement only: devices for the engines (the rest train)
    num_engines: int = 0  # 0: as many as fit (engine devices / parallel.tp); fewer leaves devices idle
    n: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Keep sampling past the end-of-sequence token up to data.max_response_length (benchmarks:
    # responses of a chosen length from any model; verl's rollout.ignore_eos). Training sampling only.
    ignore_eos: bool = False
    seed: int = 0
    gpu_memory_utilization: float = 0.6
    # Colocated placement: the engines sleep while the actor trains (KV cache freed) and wake for
    # the weight sync. Level 2 also drops their weights: every wake is followed by a full sync
    # that overwrites them, so level 1's host copy would be moved twice for nothing.
    free_cache_engine: bool = True
    sleep_level: int = 2
    max_num_batched_tokens: int = 8192
    max_concurrent_per_engine: int = 256
    # Streaming collections (early stop, async): how an engine's share of max_concurrent_per_engine
    # is counted. groups: a group holds its n slots until its last response ends; responses: a
    # finished response frees its slot, so a new group starts once n are free (the engines report
    # their running responses with each poll).
    admission: str = "groups"
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    # Vision-language models: the most images one prompt may carry (vLLM's limit_mm_per_prompt;
    # it also sizes vLLM's start-up profiling, so keep it to what the data holds). Ignored for text models.
    max_images_per_prompt: int = 1
    val_kwargs: SamplingKwargs = field(default_factory=SamplingKwargs)
    # More vLLM EngineArgs for every engine (verl: rollout.engine_kwargs.vllm.*); the ones this
    # config already sets are refused here (validate.ENGINE_ARGS_OWNED).
    engine_kwargs: Dict[str, Any] = field(default_factory=dict)
    sync: SyncConfig = field(default_factory=SyncConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    # Tools of multi-turn rollouts: built-in names (python) or path/to/file.py:function entries.
    tools: List[str] = field(default_factory=lambda: ["python"])
    # A dead engine (its process gone, or no finished group for engine_timeout_s while requests
    # are in flight; 0: no time limit) is replaced inside the step, its in-flight prompts
    # generated again, up to this many times a run; 0: a dead engine stops the run.
    max_engine_restarts: int = 0
    engine_timeout_s: float = 0.0


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    len: int = 4096
    penalty_factor: float = 1.0
    log: bool = False


@dataclass
class RewardConfig:
    custom_fn: str = ""  # path/to/file.py:function ; empty: the built-in math reward
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    num_workers: int = 0  # 0: one per CPU core
    timeout_s: float = 5.0  # hard deadline per answer; a timeout scores as incorrect
    service_url: str = ""  # use `python -m dapo_megatron.reward.serve` at this URL instead


@dataclass
class FilterGroupsConfig:
    enable: bool = True
    metric: str = "acc"  # acc | score | seq_reward | seq_final_reward
    max_num_gen_batches: int = 10  # <= 0: no limit
    on_exhausted: str = "train_partial"  # error | train_partial
    mode: str = "sync"  # sync (recipe rounds) | early_stop (async, aborts in-flight requests)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass
class TrainerConfig:
    nnodes: int = 1
    n_gpus_per_node: int = 8  # accelerators (or CPU ranks) per node
    device: str = "auto"  # auto | cuda | npu | cpu
    placement: str = "colocated"  # colocated | split
    # The run's processes. lean: the data plane's controller and storage units live in the rollout
    # manager's process (two processes fewer); full: a Ray actor each, TransferQueue's own layout,
    # which spreads them over nodes. auto: lean on one node (nnodes=1), full on several.
    layout: str = "auto"
    # sync: generation and training take turns (the recipe). one_step_off: the batch of step k + 1
    # is generated with the weights of step k - 1 while step k trains (split placement). async:
    # the rollout manager generates up to max_staleness batches ahead; weights are pushed while it
    # generates (partial_rollout) or once its batches in flight are done (partial_rollout=false).
    mode: str = "sync"
    max_staleness: int = 1  # async: policy versions the oldest token of a trained response may lag
    partial_rollout: bool = True  # async: a push reaches responses mid-generation (each token's version kept)
    # async partial rollouts: a straggler that would pass max_staleness before it is trained is
    # dropped when it finishes, its prompt back in the stream (drop), or the batch it would miss
    # waits for it (wait): verl's max_off_policy_strategy
    stale_strategy: str = "drop"
    # async partial rollouts: the share of a batch's groups that may hold a token older than the
    # weights it trains from (started before the last push): verl's staleness_threshold. The
    # rollout manager starts no stale group past the share; null: only max_staleness bounds them.
    stale_share: Optional[float] = None
    # split placement: each mini-batch (actor.ppo_mini_batch_size prompts) trains, one optimizer
    # step, as soon as its groups are scored, while the engines finish the step's others; the push
    # after the last (verl's fully-async trainer). Off: the step waits for its whole batch.
    stream_minibatches: bool = False
    # Two runs with the same seeds and config give the same metrics (clocks and memory aside) and
    # checkpoints: early-stop collection keeps groups in prompt order (waves it waits for, not the
    # first to finish), a save drains the batches asked ahead (so a resume equals the run never
    # stopped), and the device's deterministic kernels and collectives are on
    # (device/__init__.py). Async with partial rollouts: a response generates segment_tokens
    # tokens under each version before its batch's own, then waits for the push (the push waits
    # for every response to reach a segment's end or finish), so where a push lands is the step's.
    deterministic: bool = False
    segment_tokens: Optional[int] = None  # null: data.max_response_length // (max_staleness + 1)
    total_training_steps: Optional[int] = None  # null: derived from total_epochs
    total_epochs: int = 1
    save_freq: int = -1  # -1: only at the end / on SIGTERM
    test_freq: int = -1
    val_before_train: bool = True
    resume_mode: str = "auto"  # auto | disable | <path to a step folder>
    # A role that dies (a training rank, the rollout manager, an engine past its replacements)
    # restarts the run in this job from its last checkpoint, this many times (a dead training rank:
    # new ranks only, the other roles kept when safe); 0: the run stops with the role's error.
    max_restarts: int = 0
    # How long the run waits for its devices at start (and at each restart: a lost node rejoining)
    # before it stops naming this key; 0: no limit.
    placement_timeout_s: float = 1800.0
    max_checkpoints_to_keep: int = 2
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    logger: List[str] = field(default_factory=lambda: ["console", "jsonl"])
    project_name: str = "dapo-megatron"
    experiment_name: str = "dapo"
    seed: int = 1
    dist_timeout_s: int = 1800  # torch.distributed collectives (NCCL / HCCL / gloo) give up after this
    # The memory plan (`python -m dapo_megatron.plan`) runs before Ray starts and refuses a layout
    # whose predicted peak exceeds one device's memory: read from the device, or this (GB) when
    # the driver cannot see one (a CPU head node) or for another part; 0: ask the device.
    device_memory_gb: float = 0.0
    skip_memory_check: bool = False  # start anyway (a warning) when the plan says it does not fit

    @property
    def lean(self) -> bool:
        """The lean process layout (trainer.layout, auto: one node)."""
        return self.layout == "lean" or (self.layout == "auto" and self.nnodes == 1)

    @property
    def carries_in_flight(self) -> bool:
        """async with partial rollouts: the groups in flight when a batch fills go on generating
        into the next batches, across weight pushes (the rollout manager collects beside the sync)."""
        return self.mode == "async" and self.partial_rollout

    def segment_length(self, max_response_length: int) -> int:
        """trainer.deterministic with partial rollouts: the tokens per version a response of a
        batch asked ahead generates before the push its batch trains after."""
        return self.segment_tokens or max(max_response_length // (self.max_staleness + 1), 1)

    def parts(self, train_batch_size: int, ppo_mini_batch_size: int) -> int:
        """Mini-batches a step's batch is handed over in: each as its groups are in when streamed."""
        return train_batch_size // ppo_mini_batch_size if self.stream_minibatches else 1

    @property
    def batches_ahead(self) -> int:
        """Batches the rollout manager is asked for beyond the one being trained: the bound on a
        trained token's policy lag (a batch asked at step s starts with the weights of step s - 1)."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)


@dataclass
class DataPlaneConfig:
    """Where a step's rows live between engines, reward and training ranks (dapo_megatron/dataplane.py)."""
    backend: str = "transfer_queue"
    storage_units: int = 2  # TransferQueue SimpleStorage units (Ray actors; >= 2 per node spreads memory)
    capacity: int = 0  # samples all units may hold; 0: unlimited


@dataclass
class DapoConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data_plane: DataPlaneConfig = field(default_factory=DataPlaneConfig)
