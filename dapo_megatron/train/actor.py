"""The actor: a Megatron-Core policy with its optimizer; log-probs and the DAPO update.

    init_parallel(cfg.actor.parallel, seed=cfg.trainer.seed)   # once per process
    actor = Actor(cfg.actor, cfg.model.path, n=cfg.rollout.n, total_steps=..., dtype="bf16")
    rows = actor.compute_logprobs(batch)         # this rank's Rows of [B, T] log-probs, or None
    batch.old_logprobs = assemble(rows of every rank)["logprobs"]
    metrics = actor.update(batch)                # needs old_logprobs, advantages (+ ref_logprobs)

With one epoch over one mini-batch (`ActorConfig.reuses_update_forward`) the update may take no
old_logprobs: the policy it trains is, before its only optimizer step, the old one, so its own
forward (detached) is the old log-probs and the separate pass is pure cost.

Every rank is called with the same full batch and each DP rank trains on its share (see
`microbatch.split_for_dp`), or (`local=True` / `minis`) with only the rows of its share, read
from the data plane. Log-probs come back as each DP rank's rows (`logprobs.Rows`); metrics are
reduced, and every rank returns the same.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dapo_megatron.algo import Correction, LossParams, agg_loss, compute_policy_loss, kl_penalty, rollout_logprob_metrics
from dapo_megatron.batch import RolloutBatch
from dapo_megatron.config.schema import ActorConfig
from dapo_megatron.device import get_device
from dapo_megatron.models import ModelSpec, build_model
from dapo_megatron.dtypes import DTYPES
from dapo_megatron.parallel import coords, group
from dapo_megatron.train import logprobs as lp
from dapo_megatron.train import microbatch as mb
from dapo_megatron.train import routing
from dapo_megatron.train import offload
from dapo_megatron.train.optim import build_optimizer, build_scheduler, wrap_ddp
from dapo_megatron.weights import load_hf_checkpoint

# Metrics summed over micro-batches and DP: losses are already shares of the mini-batch loss;
# fractions are weighted by the micro-batch's token count and divided by the total at the end.
_SUMMED = ("pg_loss", "entropy", "kl_loss")
_CORRECTION = ("is_weight_mean", "is_masked_frac", "is_clipfrac", "rejected_frac")  # algo/correction.py's
_TOKEN_WEIGHTED = ("pg_clipfrac", "pg_clipfrac_lower", "pg_clipfrac_dual", "ppo_kl") + _CORRECTION
# The rollout-vs-trainer gap (algo.rollout_logprob_metrics), measured by the update itself when
# no old-log-prob pass ran (`ActorConfig.reuses_update_forward`): means by token, the max by max.
_GAP = ("rollout/logprob_diff_mean", "rollout/kl")
_KEYS = _SUMMED + _TOKEN_WEIGHTED + _GAP + ("tokens",)
_MAXED = ("rollout/logprob_diff_max",)


def recompute_overrides(granularity: str) -> dict:
    """TransformerConfig kwargs for `actor.recompute_granularity`."""
    if granularity in ("", None):
        return {}
    if granularity == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if granularity == "selective":
        return dict(recompute_granularity="selective")
    raise ValueError(f"unknown actor.recompute_granularity {granularity!r}; use '', full or selective")


def build_chunks(spec: ModelSpec, hf_dir: str, parallel, *, dtype: str, load: bool = True, **overrides) -> list:
    """This rank's GPTModel chunks for `spec`, the HF weights of `hf_dir` loaded (before any DDP
    wrapping, whose renamed parameters the name maps do not know)."""
    chunks = build_model(spec, dtype=dtype, sequence_parallel=parallel.sequence_parallel, **overrides)
    if load:
        load_hf_checkpoint(chunks, hf_dir)
    if coords().pp > 1:
        # Micro-batches have different shapes: let p2p send shapes first. TransformerConfig
        # refuses this with the allgather MoE dispatcher because EP ranks could then gather
        # uneven token counts; `logprobs.plan_for_rank` gives all EP ranks the same shapes.
        for chunk in chunks:
            chunk.config.variable_seq_lengths = True
    return chunks


class Actor:
    def __init__(self, cfg: ActorConfig, hf_dir: str, *, spec: ModelSpec | None = None, n: int = 1,
                 total_steps: int = 1, dtype: str = "fp32", temperature: float = 1.0, load_weights: bool = True,
                 deterministic: bool = False):
        self.cfg, self.n, self.temperature = cfg, n, temperature
        self.correction = Correction(**vars(cfg.rollout_correction))
        self.loss_params = LossParams(**vars(cfg.policy_loss_params))
        self.spec = spec = spec or ModelSpec.from_pretrained(hf_dir)
        p = cfg.parallel  # config/validate.check_parallel_fits_model explains this rule to users
        assert not (spec.is_moe and p.tp > 1 and p.ep == 1 and p.etp != p.tp), "MoE with tp > 1, ep 1 needs etp == tp"
        # deterministic (trainer.deterministic): Megatron's deterministic mode, e.g. an embedding
        # backward without atomic adds
        chunks = build_chunks(spec, hf_dir, cfg.parallel, dtype=dtype, load=load_weights, deterministic_mode=deterministic,
                              **recompute_overrides(cfg.recompute_granularity))
        # Routing replay (train/routing.py): slots on the routers; None routes freely everywhere.
        self.routes = None
        if spec.is_moe and cfg.router_replay != "off":
            self.routes = routing.install(chunks, spec.num_layers, spec.moe_top_k, record=cfg.router_replay == "actor",
                                          recompute=cfg.recompute_granularity == "full")
        self.model = wrap_ddp(chunks, use_distributed_optimizer=cfg.optim.use_distributed_optimizer)
        self.optimizer = build_optimizer(self.model, cfg.optim, DTYPES[dtype].torch)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, total_steps)
        self.offloader = offload.Offloader(
            {"params": offload.module_tensors(self.model), "grads": offload.main_grads(self.model),
             "optimizer": offload.optimizer_tensors(self.optimizer)}, get_device(), keep=("params", "optimizer"))

    def offload(self, what: list[str]) -> None:
        """Keep these of `offload.GROUPS` in host memory (colocated placement, while engines generate)."""
        self.offloader.offload(what)

    def onload(self, what: list[str]) -> None:
        self.offloader.onload(what)

    def _on_device(self, *what: str) -> None:
        # An offloaded storage is empty: reading it would crash the process (or read freed
        # device memory), so the calls that need the state say what is missing instead.
        missing = [w for w in what if w in self.offloader.offloaded]
        if missing:
            raise RuntimeError(f"the actor's {', '.join(missing)} are offloaded (actor.offload); onload them first")

    @property
    def chunks(self) -> list:
        """The bare GPTModel chunks (for weight export; same parameters as the DDP-wrapped model)."""
        self._on_device("params")
        return [m.module for m in self.model]

    def compute_logprobs(self, batch: RolloutBatch, with_entropy: bool = False, local: bool = False) -> lp.Rows | None:
        """This rank's rows of the response tokens' log-probs (and entropy) [n, T], or None on a
        rank that reports none (see `logprobs.compute_logprobs`)."""
        self._on_device("params")
        return lp.compute_logprobs(self.model, self.spec.arch, batch, max_tokens=self.cfg.max_tokens_per_microbatch,
                                   vocab_size=self.spec.vocab_size, temperature=self.temperature,
                                   with_entropy=with_entropy, routes=self.routes, local=local)

    def minibatches(self, sequence_lengths: list[int], loss_tokens: list[int]) -> list[tuple[list[int], tuple[int, int]]]:
        """This DP rank's rows of each mini-batch (ppo_mini_batch_size * n responses) of a batch
        with these lengths, with the mini-batch's global loss normalisers (`microbatch.minibatch_shares`)."""
        c = coords()
        return mb.minibatch_shares(sequence_lengths, loss_tokens, self.cfg.ppo_mini_batch_size * self.n, c.dp, c.dp_rank)

    def update(self, batch: RolloutBatch, minis: list | None = None, tokens: int | None = None,
               new_step: bool = True) -> dict:
        """ppo_epochs x mini-batches of ppo_mini_batch_size * n responses; one optimizer step each.

        Without `minis` every rank holds the whole batch; with them `batch` holds this rank's rows
        only and `minis` lists, per mini-batch, its rows in `batch` and the global normalisers
        (`minibatches`, mapped to `batch`). `tokens`: the whole batch's, for perf/actor_tokens_per_s.
        `new_step`: the schedule counts an RL step (False: a later streamed mini-batch of one)."""
        if batch.advantages is None:
            raise ValueError("Actor.update needs batch.advantages")
        if self.cfg.use_kl_loss and batch.ref_logprobs is None:
            raise ValueError("actor.use_kl_loss is on but batch.ref_logprobs is None; compute them with the "
                             "reference model or set actor.use_kl_loss=false")
        self._on_device(*offload.GROUPS)
        start = time.perf_counter()
        if new_step:
            self.scheduler.step(1)  # warm-up counts RL steps; step 1 trains with lr / warmup, not 0
        if minis is None:
            minis = self.minibatches(batch.sequence_lengths, batch.loss_mask.bool().sum(1).tolist())
        if batch.old_logprobs is None and self.cfg.runs_old_logprob_pass(self.n, sum(c[1] for _, c in minis)):
            raise ValueError(f"Actor.update needs batch.old_logprobs (from compute_logprobs): with {len(minis)} "
                             f"mini-batches x {self.cfg.ppo_epochs} epochs (actor.old_logprobs={self.cfg.old_logprobs}) "
                             "the update's own forward is not the old policy")
        steps = []
        for _ in range(self.cfg.ppo_epochs):
            for rows, counts in minis:
                steps.append(self._train_minibatch(batch.select(rows), counts))
        tokens = (tokens if tokens is not None else sum(batch.sequence_lengths)) * self.cfg.ppo_epochs
        # means over the optimizer steps; a maximum (the rollout gap's) is the largest of theirs
        metrics = {k: max(m[k] for m in steps) if k in _MAXED else sum(m[k] for m in steps) / len(steps)
                   for k in steps[0]}
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["perf/actor_tokens_per_s"] = tokens / (time.perf_counter() - start)
        return metrics

    def _train_minibatch(self, batch: RolloutBatch, counts: tuple[int, int]) -> dict:
        """One optimizer step on this rank's rows of a mini-batch; `counts`: the mini-batch's
        (loss tokens, samples) over every DP rank (the token-level loss divides by them)."""
        plan = lp.plan_for_rank(batch, self.cfg.max_tokens_per_microbatch, local=True)
        micros = mb.materialize(batch, plan)
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        with routing.routing_mode(self.routes, update=True):
            results = lp.forward_backward(self.model, self.spec.arch, micros,
                                          lambda m, out: self._loss(counts, m, out), forward_only=False)
            # how often the policy being trained still routes as the replayed routes say
            agree = routing.agreement(self.routes.flat) if self.routes is not None else None
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("the optimizer step was skipped (non-finite gradients)")
        totals = self._reduce_metrics(results)
        out = {f"actor/{k}": totals[k] for k in _SUMMED if k != "kl_loss" or self.cfg.use_kl_loss}
        for k in _TOKEN_WEIGHTED:  # the correction's own metrics where its parts are on
            if k not in _CORRECTION or k in self.correction.metric_names:
                out[f"{'rollout' if k == 'rejected_frac' else 'actor'}/{k}"] = totals[k] / max(totals["tokens"], 1.0)
        out["actor/grad_norm"] = float(grad_norm)
        if agree is not None:
            out["actor/router_agreement"] = agree
        if batch.old_logprobs is None:  # no old-log-prob pass ran: what it measured, this forward did
            if batch.rollout_logprobs is not None:
                out.update({k: totals[k] / max(totals["tokens"], 1.0) for k in _GAP}, **{k: totals[k] for k in _MAXED})
            if agree is not None:
                out["rollout/router_agreement"] = agree
        return out

    def _loss(self, counts: tuple[int, int], micro: mb.MicroBatch, output: torch.Tensor):
        """Loss of one micro-batch as its share of the mini-batch loss; returns Megatron's
        (loss, token count, metrics) triple."""
        cfg, dev = self.cfg, output.device
        mask = micro.loss_mask.to(dev)  # [b, T]
        tok_lp, tok_ent = lp.token_logprobs(output, micro.labels.to(dev), self.spec.vocab_size,
                                            temperature=self.temperature, with_entropy=True,
                                            entropy_grad=cfg.entropy_coeff != 0)
        logprobs, entropy = lp.response_aligned(tok_lp, micro), lp.response_aligned(tok_ent, micro)  # [b, T]
        glob = dict(global_token_count=counts[0], global_seq_count=counts[1])
        rollout = None if micro.rollout_logprobs is None else micro.rollout_logprobs.to(dev)
        ntok = mask.sum()
        data = {}
        if micro.old_logprobs is not None:
            old = micro.old_logprobs.to(dev)
        else:  # the engine's (actor.old_logprobs=rollout), or exactly on-policy: the weights scoring now
            if cfg.old_logprobs == "rollout" and rollout is None:
                raise ValueError("actor.old_logprobs=rollout needs the engine's log-probs (rollout_logprobs)")
            old = rollout if cfg.old_logprobs == "rollout" else logprobs.detach()
            if rollout is not None:
                gap = rollout_logprob_metrics(rollout, logprobs.detach(), mask)
                data.update({k: float(gap[k]) * float(ntok) for k in _GAP}, **{k: float(gap[k]) for k in _MAXED})
        pg_loss, m = compute_policy_loss(
            old, logprobs, micro.advantages.to(dev), mask,  # advantages [b]
            clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
            loss_agg_mode=cfg.loss_agg_mode, policy_loss=cfg.policy_loss,
            rollout_logprobs=rollout, correction=self.correction, params=self.loss_params, **glob)
        ent_loss = agg_loss(entropy, mask, cfg.loss_agg_mode, **glob)
        loss = pg_loss - cfg.entropy_coeff * ent_loss
        data.update({k: float(m[k]) * float(ntok) for k in _TOKEN_WEIGHTED if k in m})  # m is detached
        data.update(pg_loss=float(pg_loss.detach()), entropy=float(ent_loss.detach()), tokens=float(ntok))
        if cfg.use_kl_loss:
            kl = kl_penalty(logprobs, micro.ref_logprobs.to(dev), cfg.kl_loss_type)  # [b, T]
            kl_loss = agg_loss(kl, mask, cfg.loss_agg_mode, **glob)
            loss = loss + cfg.kl_loss_coef * kl_loss
            data["kl_loss"] = float(kl_loss.detach())
        return loss, ntok.to(torch.int), data

    def _reduce_metrics(self, results: list) -> dict:
        """Sum micro-batch metrics over this rank and DP (`_MAXED`: the max); the last pipeline
        stage broadcasts."""
        dev = next(self.model[0].parameters()).device
        sums = torch.tensor([sum(r.get(k, 0.0) for r in results) for k in _KEYS], dtype=torch.float64, device=dev)
        maxima = torch.tensor([max((r.get(k, 0.0) for r in results), default=0.0) for k in _MAXED],
                              dtype=torch.float64, device=dev)
        dist.all_reduce(sums, group=group("dp"))
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group("dp"))
        vec = torch.cat([sums, maxima])
        c = coords()
        if c.pp > 1:
            dist.broadcast(vec, src=c.pp_last_rank, group=group("pp"))
        return dict(zip(_KEYS + _MAXED, vec.cpu().tolist()))
