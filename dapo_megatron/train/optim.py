"""Megatron DDP wrapping, optimizer and LR/WD schedule from `actor.optim`.

Gradient reduction contract (see algo/loss.py): every micro-batch loss is already divided by the
mini-batch's global token (or sequence) count, so gradients must be SUMMED over micro-batches and
DP ranks. `calculate_per_token_loss=True` makes Megatron's DDP sum over DP (scaling factor 1) and
its schedules skip the 1/num_microbatches division; `finalize_grads` then skips the final
1/num_tokens scaling that this mode would otherwise apply.
"""
from __future__ import annotations

import torch

from dapo_megatron.config.schema import OptimConfig

_DECAY_STYLES = {"constant": "constant", "cosine": "cosine", "linear": "linear"}


def finalize_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """Megatron's finalize_model_grads without the per-token division (our loss is normalised)."""
    from megatron.core.distributed import finalize_model_grads
    return finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def wrap_ddp(chunks: list, *, use_distributed_optimizer: bool) -> list:
    """Wrap model chunks in Megatron's DistributedDataParallel (fp32 grad buffers, SUM over DP)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=use_distributed_optimizer)
    config = chunks[0].config
    config.calculate_per_token_loss = True  # must be set before DDP picks its scaling factor
    wrapped = []
    for i, chunk in enumerate(chunks):
        ddp = DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                      disable_bucketing=i > 0)  # Megatron-LM: buckets on chunk 0 only
        ddp.broadcast_params()  # identical replicas across DP even if init RNG drifted
        wrapped.append(ddp)
    config.finalize_model_grads_func = finalize_grads
    return wrapped


def optimizer_config(cfg: OptimConfig, dtype: torch.dtype):
    """Megatron's OptimizerConfig of `actor.optim`: Adam with decoupled weight decay.

    actor.optim.cpu_offload turns on Megatron's CPU optimizer as slime and verl's recipes run it:
    precision-aware, so the fp32 masters of the offloaded share are made on the host by the hybrid
    optimizer instead of on the device by the distributed one; copies overlapped on side streams."""
    from megatron.core.optimizer import OptimizerConfig
    if len(cfg.betas) != 2:
        raise ValueError(f"actor.optim.betas must have 2 values, got {cfg.betas}")
    cpu = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=cfg.cpu_offload_fraction,
               use_precision_aware_optimizer=True, overlap_cpu_optimizer_d2h_h2d=True) if cfg.cpu_offload else {}
    return OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1], clip_grad=cfg.clip_grad,
        use_distributed_optimizer=cfg.use_distributed_optimizer, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, **cpu)


def build_optimizer(chunks: list, cfg: OptimConfig, dtype: torch.dtype):
    """Megatron's optimizer (Adam, decoupled weight decay; distributed when configured)."""
    from megatron.core.optimizer import get_megatron_optimizer
    optimizer = get_megatron_optimizer(optimizer_config(cfg, dtype), chunks)
    config = chunks[0].config
    config.grad_scale_func = getattr(optimizer, "scale_loss", None) if dtype == torch.float16 else None
    return optimizer


def build_scheduler(optimizer, cfg: OptimConfig, total_steps: int):
    """Linear warm-up from 0 over lr_warmup_steps, then constant / cosine / linear to min_lr.

    The driver steps it once per RL step (`Actor.update`), before the optimizer steps, so step 1
    already trains with lr / lr_warmup_steps instead of 0.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    if cfg.lr_scheduler not in _DECAY_STYLES:
        raise ValueError(f"unknown actor.optim.lr_scheduler {cfg.lr_scheduler!r}; use one of "
                         f"{', '.join(_DECAY_STYLES)}")
    decay_steps = max(total_steps, cfg.lr_warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=cfg.lr_warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=_DECAY_STYLES[cfg.lr_scheduler],
        start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=decay_steps,
        wd_incr_style="constant")
