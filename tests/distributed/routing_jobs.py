"""Worker job for the routing-replay tests: record routes, replay them, perturb the routers, train
with and without activation recompute; every rank runs it (see `train.parallel.run_workers`)."""
from __future__ import annotations

import torch

from dapo_megatron.batch import unpad_positions
from dapo_megatron.config.schema import ParallelConfig

import actor_jobs


def _routers(actor) -> list:
    from megatron.core.transformer.moe.router import TopKRouter
    return [m for chunk in actor.chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def _perturb_routers(actor, scale: float) -> None:
    """Add seeded noise to the last layer's router (same on every rank: routers are replicated).
    Only the last: the layers before it then see the same inputs with and without replay, so
    the agreement measured under replay must equal the share of sets free routing kept."""
    for router in _routers(actor):
        if router.layer_number != router.config.num_layers:
            continue
        g = torch.Generator().manual_seed(1000 + router.layer_number)
        noise = torch.randn(router.weight.shape, generator=g) * scale * router.weight.detach().abs().mean()
        router.weight.data.add_(noise.to(router.weight.dtype))


def _pass(actor, batch):
    """(log-probs [B, T], routes this pass used as a position column, metrics)."""
    import torch.distributed as dist
    from dapo_megatron.train.logprobs import assemble
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, actor.compute_logprobs(batch))
    out = assemble(parts)
    metrics = next(p.metrics for p in parts if p is not None)
    return out["logprobs"], unpad_positions(out["routed_experts"], batch.sequence_lengths), metrics


def _updated_weights(hf_dir, parallel, batch, old_logprobs, *, recompute: str, perturb: float) -> dict:
    from dapo_megatron.train.actor import Actor
    actor = Actor(actor_jobs.actor_config(parallel, router_replay="actor", recompute_granularity=recompute,
                                          max_tokens_per_microbatch=96, use_kl_loss=False), hf_dir, n=2)
    _perturb_routers(actor, perturb)
    batch.old_logprobs = old_logprobs
    actor.update(batch)
    return actor_jobs.export_weights(actor.chunks)


def replay_job(hf_dir: str, parallel: dict, batch, perturb: float) -> bytes:
    from dapo_megatron.train.actor import Actor
    from dapo_megatron.train.parallel import init_parallel
    init_parallel(ParallelConfig(**parallel))
    cfg = actor_jobs.actor_config(parallel, router_replay="actor", max_tokens_per_microbatch=96)
    actor = Actor(cfg, hf_dir, n=2)
    if torch.distributed.get_world_size() == 1:
        # a lone rank gets both cores (device._share_cores), and its two passes then differed in the
        # last bits in 3 of ~62 fresh-clone CI runs: one thread adds in one order, as the others do
        torch.set_num_threads(1)
    out = {}
    # 1. record (no routes in the batch: the routers choose), 2. replay what was recorded
    out["lp0"], routes0, out["m0"] = _pass(actor, batch)
    replayed = batch.select(list(range(len(batch))))
    replayed.routed_experts = routes0
    out["lp1"], out["routes1"], out["m1"] = _pass(actor, replayed)
    out["routes0"] = routes0
    # 3. perturbed routers: free routing vs replay of the recorded routes
    _perturb_routers(actor, perturb)
    out["lp2"], out["routes2"], out["m2"] = _pass(actor, batch)
    out["lp3"], out["routes3"], out["m3"] = _pass(actor, replayed)
    # 4. one update under replay with perturbed routers, with and without full recompute (the
    #    recompute must replay the same routes as its forward), and without replay.
    replayed.advantages = batch.advantages
    old = actor_jobs.perturbed_old(out["lp0"])
    out["w_plain"] = _updated_weights(hf_dir, parallel, replayed, old, recompute="", perturb=perturb)
    out["w_recompute"] = _updated_weights(hf_dir, parallel, replayed, old, recompute="full", perturb=perturb)
    out["w_free"] = _updated_weights(hf_dir, parallel, batch, old, recompute="", perturb=perturb)
    return actor_jobs.pack(out)
