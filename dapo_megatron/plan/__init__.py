"""Will it fit? A memory plan per device for a config and a model, before anything starts.

`make_plan(cfg, spec, device_bytes)` adds up, per phase of a step, what one device holds:

    generate     the engine's share (gpu_memory_utilization x memory) + what the actor keeps
    log-probs    the actor's state (onloaded) + the reference's weights + a forward's working set
    update       the actor's state + saved activations + the logits of one micro-batch
    weight sync  the actor's parameters + the engine's weights + the sync buckets

and per moment of a run that is not a step (the order driver/moments.Moments.start and driver/colocate.py
follow: the engines asleep while the training ranks build or load):

    start-up     the actor's whole state as built (HF weights or model.load_checkpoint) + the reference's
    resume       the actor's parameters and optimizer state + the checkpoint's optimizer state read
                 into fresh tensors before the copy (the gradients offloaded first, colocated)
    restart      new training ranks built beside the kept engines, asleep: the start-up's terms
    engine replacement  a new engine allocating its share in the step's sync, the parameters still there

Colocated placement with `rollout.free_cache_engine` puts the engines to sleep outside
generation and `actor.offload.*` keeps the actor's state in host memory during it
(driver/colocate.py); split placement gives each role its own devices. The training state is
exact (plan/state.py, checked against Megatron's allocations); activations follow
plan/activations.py; the engine's share is what vLLM allocates. `check` refuses a plan whose
peak exceeds the device, naming the largest term's key.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from dapo_megatron.config import ConfigError, role_devices
from dapo_megatron.device import Device, detect
from dapo_megatron.plan.activations import layer_bytes_per_token, logits_bytes, shape_of, training_bytes
from dapo_megatron.plan.state import DTYPE_BYTES, Layout, reference_params, worst_rank_state
from dapo_megatron.weights.name_map import expected_hf_shapes

GiB = 2 ** 30  # what an "80 GB" H100 (79.6 GiB usable) or a "64 GB" NPU is counted in
# Per process on an accelerator: the runtime's context, the collectives' buffers and allocator
# slack (assumed, not measured: CUDA / CANN contexts are ~0.5 GiB, NCCL / HCCL buffers similar).
RUNTIME_BYTES = 1.0 * GiB

# term -> the key that shrinks it (named in a refusal). While the engines generate, the actor's
# state can wait in host memory; while it trains, only more ranks (or a smaller share per rank) help.
KEYS = {
    "params": "actor.parallel.tp",
    "grads": "actor.parallel.tp",
    "optimizer": "trainer.nnodes",  # the distributed optimizer shards it over (expert-)DP ranks
    "activations": "actor.max_tokens_per_microbatch",
    "logits": "actor.max_tokens_per_microbatch",
    "forward": "actor.max_tokens_per_microbatch",
    "ref params": "ref.offload",
    "engine share": "rollout.gpu_memory_utilization",
    "engine weights": "rollout.parallel.tp",
    "sync buckets": "rollout.sync.bucket_mb",
    "runtime": "trainer.device_memory_gb",
    "checkpoint load": "trainer.nnodes",  # the optimizer's shard, read once more
}
# Host bytes of Megatron's CPU optimizer per byte of the optimizer state it takes (a 16-bit shard's
# fp32 master 4 + Adam's moments 8 = 12 B per parameter): + its 16-bit host copy 2 and fp32 grad 4.
HOST_PER_OPTIMIZER_BYTE = 18 / 12
GENERATE_KEYS = {"params": "actor.offload.params", "grads": "actor.offload.grads",
                 "optimizer": "actor.offload.optimizer"}


@dataclass
class Phase:
    name: str
    terms: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.terms.values())


@dataclass
class Plan:
    title: str
    device_bytes: float | None  # None: unknown here (the plan prints, nothing is refused)
    per_rank: dict[str, float]  # the rank's parts, whatever phase they live in
    phases: list[Phase]
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return self.device_bytes is None or self.peak.total <= self.device_bytes


def _engine(cfg, spec, device_bytes: float | None) -> tuple[dict[str, float], list[str]]:
    """The engine worker's share of a device (vLLM allocates gpu_memory_utilization of it) and
    what the share holds: weights split over the engine's TP, the forward's working set of a
    max_num_batched_tokens step (estimated), the KV cache in what is left."""
    r, b = cfg.rollout, DTYPE_BYTES[cfg.model.dtype]
    tp = r.parallel.tp
    weights = sum(math.prod(s) for s in expected_hf_shapes(spec, files=False).values()) * b / tp
    width = 2 * spec.hidden_size + 3 * (spec.moe_top_k * spec.moe_ffn_hidden_size if spec.is_moe else spec.ffn_hidden_size) / tp
    working = r.max_num_batched_tokens * width * b + r.max_concurrent_per_engine * spec.vocab_size * 4
    kv_per_token = 2 * spec.num_layers * max(spec.num_kv_heads // tp, 1) * spec.head_dim * b
    out = {"engine weights": weights, "engine working set": working}
    notes = []
    if device_bytes is None:
        return out, notes
    share = r.gpu_memory_utilization * device_bytes
    kv = share - weights - working
    out["engine KV cache"] = max(kv, 0.0)
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    if kv <= 0:
        notes.append(f"engine: weights {weights / GiB:.1f} GiB + working set {working / GiB:.1f} GiB exceed its share "
                     f"{share / GiB:.1f} GiB: raise rollout.gpu_memory_utilization or rollout.parallel.tp")
    elif kv / kv_per_token < r.max_concurrent_per_engine * seq:
        fit = int(kv / kv_per_token // seq)
        notes.append(f"engine KV cache: {kv / GiB:.1f} GiB = {int(kv / kv_per_token)} tokens holds {fit} sequences of "
                     f"{seq} tokens, not rollout.max_concurrent_per_engine={r.max_concurrent_per_engine}: vLLM "
                     "queues or preempts the rest (slower, not out of memory)")
    return out, notes


def device_bytes(cfg, override_gb: float = 0.0) -> tuple[float | None, bool]:
    """(one device's memory in bytes, None where this host cannot tell; whether its kind runs
    flash attention). CPU: the host's RAM over the node's ranks."""
    kind = detect() if cfg.trainer.device == "auto" else cfg.trainer.device
    device = Device(kind)
    gb = override_gb or cfg.trainer.device_memory_gb
    if gb:
        return gb * GiB, device.flash_attention
    if kind == "cpu":
        return device.total_memory_bytes() / cfg.trainer.n_gpus_per_node, False
    return (device.total_memory_bytes() if detect() == kind else None), device.flash_attention


def _activations(cfg, spec, flash: bool) -> tuple[dict, float, int]:
    """The update's activation terms on the worst stage, the log-prob pass's forward, and the
    tokens of a micro-batch."""
    a, p = cfg.actor, cfg.actor.parallel
    s = shape_of(spec, p, dtype_bytes=DTYPE_BYTES[cfg.model.dtype])
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    tokens = max(a.max_tokens_per_microbatch, seq)  # a longer sequence gets a micro-batch of its own
    layers = spec.num_layers // p.pp
    # The first stage keeps pp micro-batches in flight under 1F1B, the last one its logits.
    first = training_bytes(s, layers=layers, in_flight=p.pp, tokens=tokens, seq_len=seq, flash=flash,
                           recompute=a.recompute_granularity, last_stage=p.pp == 1, entropy_grad=a.entropy_coeff != 0)
    last = training_bytes(s, layers=layers, in_flight=1, tokens=tokens, seq_len=seq, flash=flash,
                          recompute=a.recompute_granularity, last_stage=True, entropy_grad=a.entropy_coeff != 0)
    forward = (layer_bytes_per_token(s, seq, flash=flash, recompute="") * tokens
               + logits_bytes(s, tokens, backward=False, entropy_grad=False))
    return max(first, last, key=lambda t: sum(t.values())), forward, tokens


def _host_notes(cfg, spec, optimizer: float, actor_devices: int) -> list[str]:
    """What the plan says beside the device terms: the host memory of Megatron's CPU optimizer
    (`optimizer`: a rank's optimizer bytes, the share it steps on the host), the vision tower's
    activations not counted."""
    notes = []
    optim = cfg.actor.optim
    if optim.cpu_offload:
        on_host = optim.cpu_offload_fraction
        host = optimizer * on_host * HOST_PER_OPTIMIZER_BYTE
        notes.append(f"the CPU optimizer holds {host / GiB:.1f} GiB per actor rank in host memory "
                     f"({host * min(actor_devices, cfg.trainer.n_gpus_per_node) / GiB:.0f} GiB per node): "
                     f"{on_host:.0%} of its fp32 masters and Adam's moments, with a 16-bit copy and an fp32 "
                     "gradient of each parameter it steps")
    if spec.vision_config:
        notes.append("the vision tower's parameters are counted; its activations are not (images are few "
                     "hundred tokens beside thousands of text tokens)")
    return notes


def make_plan(cfg, spec, memory: float | None, *, flash: bool = True) -> Plan:
    """The plan of `cfg` (a validated DapoConfig) for `spec`, on devices of `memory` bytes."""
    a, r = cfg.actor, cfg.rollout
    devices = role_devices(cfg)
    p = a.parallel
    lay = Layout.of(p, devices["actor"])
    state, stage = worst_rank_state(spec, lay, dtype=cfg.model.dtype,
                                    distributed_optimizer=a.optim.use_distributed_optimizer)
    train, forward, tokens = _activations(cfg, spec, flash)
    recompute = a.recompute_granularity
    ref = (reference_params(spec, Layout.of(cfg.ref.parallel, devices["ref"]), dtype=cfg.model.dtype)
           if a.use_kl_loss else 0)
    engine, notes = _engine(cfg, spec, memory)
    share = r.gpu_memory_utilization * memory if memory else sum(engine.values())
    colocated = cfg.trainer.placement == "colocated"
    sleeps = colocated and r.free_cache_engine
    runtime = RUNTIME_BYTES * (2 if colocated else 1)
    # Megatron's CPU optimizer keeps its share of the optimizer (masters, moments, steps) on the
    # host the whole run, where it also reads a resume's state (rounded to whole parameters).
    on_host = a.optim.cpu_offload_fraction if a.optim.cpu_offload else 0.0
    actor = {"params": state.params, "grads": state.grads, "optimizer": state.optimizer * (1 - on_host)}
    kept = {k: v for k, v in actor.items() if not (colocated and getattr(a.offload, k))}
    resident_ref = {"ref params": ref} if ref and not cfg.ref.offload else {}
    awake = {"engine share": share} if colocated and not sleeps else {}
    step = [
        Phase("log-probs", {**actor, "ref params": ref, "forward": forward, **awake, "runtime": runtime}),
        Phase("update", {**actor, **resident_ref, **train, **awake, "runtime": runtime}),
    ]
    # A run's moments besides its steps, first in the table as in the run. The engines sleep before
    # the ranks build (colocated with free_cache_engine), so these hold the actor and what the
    # engines keep awake, if anything.
    built = {**actor, **({"ref params": ref} if ref else {}), **awake, "runtime": runtime}
    grads_out = colocated and a.offload.grads
    resumed = {**{k: v for k, v in actor.items() if not (k == "grads" and grads_out)},
               "checkpoint load": actor["optimizer"], **resident_ref, **awake, "runtime": runtime}
    moments = [Phase("start-up", built), Phase("resume", resumed)]
    if cfg.trainer.max_restarts:
        moments.append(Phase("restart", dict(built)))
    phases = moments + step
    if colocated:
        phases.insert(len(moments), Phase("generate", {**kept, **resident_ref, "engine share": share,
                                                       "runtime": runtime}))
        offloaded_sync = {k: v for k, v in actor.items() if k == "params" or not getattr(a.offload, k)}
        phases.append(Phase("weight sync", {**offloaded_sync, **resident_ref,
                                            **({"engine share": share} if not sleeps else
                                               {"engine weights": engine["engine weights"]}),
                                            "sync buckets": 2 * r.sync.bucket_mb * 2 ** 20, "runtime": runtime}))
        if r.max_engine_restarts:  # a dead engine's replacement starts awake beside the resident params
            phases.append(Phase("engine replacement", {"params": state.params, **resident_ref,
                                                       "engine share": share, "runtime": runtime}))
    else:
        notes.append(f"engine devices ({devices['rollout']}): the engine's share "
                     f"{share / GiB:.1f} GiB + runtime of {RUNTIME_BYTES / GiB:.1f} GiB each")
    notes += _host_notes(cfg, spec, state.optimizer, devices["actor"])
    dp, edp = lay.dp, lay.edp
    title = (f"{spec.model_type}: actor TP{p.tp} PP{p.pp} EP{p.ep} ETP{p.etp} on {lay.world} devices (DP {dp}, "
             f"expert-DP {edp}), {cfg.model.dtype}, {cfg.trainer.placement}; micro-batch {tokens} tokens, "
             f"recompute {recompute or 'none'}; worst rank: pipeline stage {stage}")
    per_rank = {**actor, **train, "forward": forward, "ref params": ref, **engine}
    return Plan(title, memory, per_rank, phases, notes)


def render(plan: Plan) -> str:
    lines = [plan.title, "", "per rank (GiB)"]
    lines += [f"  {name:<22} {v / GiB:8.2f}" for name, v in plan.per_rank.items() if v]
    names = list(dict.fromkeys(k for ph in plan.phases for k in ph.terms))
    w = max(len(ph.name) for ph in plan.phases) + 1
    lines += ["", f"{'phase':<{w}}" + "".join(f"{n[:12]:>13}" for n in names) + f"{'total':>10}"]
    for ph in plan.phases:
        lines.append(f"{ph.name:<{w}}" + "".join(f"{ph.terms[n] / GiB:13.2f}" if n in ph.terms else f"{'-':>13}"
                                                for n in names) + f"{ph.total / GiB:10.2f}")
    peak = plan.peak
    if plan.device_bytes is None:
        lines.append(f"\npeak: {peak.name} {peak.total / GiB:.1f} GiB; device memory unknown here "
                     "(set trainer.device_memory_gb)")
    else:
        room = plan.device_bytes - peak.total
        verdict = (f"fits, {room / GiB:.1f} GiB ({room / plan.device_bytes:.0%}) headroom" if room >= 0
                   else f"DOES NOT FIT: {-room / GiB:.1f} GiB over")
        lines.append(f"\npeak: {peak.name} {peak.total / GiB:.1f} GiB of {plan.device_bytes / GiB:.1f} GiB: {verdict}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def check(plan: Plan) -> None:
    """Raise ConfigError when the peak exceeds the device, naming the largest term's key."""
    if plan.fits:
        return
    peak = plan.peak
    term, size = max(peak.terms.items(), key=lambda kv: kv[1])
    key = (GENERATE_KEYS if peak.name == "generate" else {}).get(term) or KEYS.get(term, "trainer.device_memory_gb")
    raise ConfigError(key, f"memory plan: the {peak.name} phase needs {peak.total / GiB:.1f} GiB per device, more "
                           f"than its {plan.device_bytes / GiB:.1f} GiB; the largest term is {term} "
                           f"({size / GiB:.1f} GiB): change {key} (python -m dapo_megatron.plan shows every term; "
                           "trainer.skip_memory_check=true starts anyway)")


def max_response_length(cfg, spec, device_bytes: float, *, flash: bool = True, step: int = 1024,
                        limit: int = 1 << 18) -> int:
    """The largest data.max_response_length (a multiple of `step`) whose plan fits; 0: none."""
    import copy
    best, lo, hi = 0, 1, limit // step
    while lo <= hi:
        mid = (lo + hi) // 2
        trial = copy.deepcopy(cfg)
        trial.data.max_response_length = mid * step
        if make_plan(trial, spec, device_bytes, flash=flash).fits:
            best, lo = mid * step, mid + 1
        else:
            hi = mid - 1
    return best
