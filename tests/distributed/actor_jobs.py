"""Worker jobs for the actor / reference / checkpoint tests; each runs on every rank of a local
gloo group (see `train.parallel.run_workers`). Several checks share one job per layout because
each job starts processes, a gloo group and the models.
"""
from __future__ import annotations

import io
import os

import torch

from dapo_megatron.batch import RolloutBatch
from dapo_megatron.config.schema import ActorConfig, OptimConfig, ParallelConfig, RefConfig, RolloutCorrectionConfig


def pack(obj) -> bytes:
    """Results go back as torch.save bytes: many tensors through the multiprocessing queue's
    shared-memory path hung the parent (seen with ~100 exported tensors)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(blob: bytes):
    return torch.load(io.BytesIO(blob), weights_only=False)


def make_batch(n_samples: int = 8, vocab: int = 509, seed: int = 0, max_prompt: int = 9,
               max_response: int = 12) -> RolloutBatch:
    """Ragged prompts / responses and per-sequence advantages (grouped by 2)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (int(torch.randint(2, max_prompt + 1, (1,), generator=g)),), generator=g)
               for _ in range(n_samples)]
    responses = [torch.randint(0, vocab, (int(torch.randint(1, max_response + 1, (1,), generator=g)),), generator=g)
                 for _ in range(n_samples)]
    batch = RolloutBatch(prompts=prompts, responses=responses, group=torch.arange(n_samples) // 2,
                         prompt_index=torch.arange(n_samples) // 2)
    batch.advantages = torch.randn(n_samples, generator=g)  # [B]
    return batch


def everywhere(rows) -> dict:
    """Every rank's `logprobs.Rows` joined into full [B, T] tensors on every rank: what the driver
    does with the ranks' answers (`assemble`), done inside a test job."""
    import torch.distributed as dist
    from dapo_megatron.train.logprobs import assemble
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, rows)
    return assemble(parts)


def actor_config(parallel: dict, **over) -> ActorConfig:
    # lr 1e-4: Adam's first step is ~lr * sign(grad), 10x the 1e-5 layout comparison, so an update
    # that differs in sign or misses a tensor shows (assert_same_weights).
    optim = OptimConfig(**{**dict(lr=1e-4, weight_decay=0.1, lr_warmup_steps=0, clip_grad=1.0),
                           **over.pop("optim", {})})
    kw = dict(ppo_mini_batch_size=4, ppo_epochs=1, max_tokens_per_microbatch=1 << 14, clip_ratio_c=3.0,
              entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
              rollout_correction=RolloutCorrectionConfig(is_level=None))  # as validation resolves it in sync mode
    kw.update(over)
    return ActorConfig(parallel=ParallelConfig(**parallel), optim=optim, **kw)


def perturbed_old(logprobs: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """old_logprobs = current + noise, so that ratios differ from 1 and the clips engage."""
    g = torch.Generator().manual_seed(seed)
    return logprobs + 0.3 * torch.randn(logprobs.shape, generator=g)


def export_weights(chunks) -> dict:
    from dapo_megatron.weights import export_hf
    return {name: t.clone() for bucket in export_hf(chunks, bucket_bytes=1 << 20) for name, t in bucket}


def logprob_job(hf_dirs: list[str], parallel: dict, batch: RolloutBatch, max_tokens: int, init: bool = True) -> list:
    """Per model: actor log-probs + entropy and reference log-probs of `batch`."""
    from dapo_megatron.train.actor import Actor
    from dapo_megatron.train.parallel import init_parallel
    from dapo_megatron.train.reference import Reference
    if init:
        init_parallel(ParallelConfig(**parallel))
    out = []
    for d in hf_dirs:
        actor = Actor(actor_config(parallel, max_tokens_per_microbatch=max_tokens), d)
        res = everywhere(actor.compute_logprobs(batch, with_entropy=True))
        ref = Reference(RefConfig(parallel=ParallelConfig(**parallel)), d, max_tokens_per_microbatch=max_tokens)
        res["ref"] = everywhere(ref.compute_logprobs(batch))["logprobs"]
        out.append(res)
    return out


def run_updates(hf_dir: str, parallel: dict, batch: RolloutBatch, over: dict, steps: int = 1) -> dict:
    """`steps` updates from the HF weights; returns per-step metrics, the new log-probs, the
    exported (HF-named) weights of this rank before and after, and the lr.

    `over["old"]`: the old log-probs are the pass's plus noise (`perturbed`, the clips engage),
    the pass's exactly (`exact`), none (`update`: the update's own forward), the engine's given as
    old log-probs (`as_rollout`), or none with actor.old_logprobs=rollout (`rollout`: the engine's
    taken by the update); with all but the first the batch carries engine log-probs (the pass's +
    noise) and `gap` is their expected metrics. `over["stream"]`: one update call per mini-batch
    (trainer.stream_minibatches), the schedule stepped by the first."""
    from dapo_megatron.algo import rollout_logprob_metrics
    from dapo_megatron.train.actor import Actor
    over = dict(over)
    old, stream = over.pop("old", "perturbed"), over.pop("stream", False)
    config = actor_config(parallel, **over, **({"old_logprobs": "rollout"} if old == "rollout" else {}))
    actor = Actor(config, hf_dir, n=2)
    before = export_weights(actor.chunks)
    batch = batch.select(list(range(len(batch))))  # a copy: the module's batch stays as it is
    current = everywhere(actor.compute_logprobs(batch))["logprobs"]
    gap = None
    if old == "perturbed":
        batch.old_logprobs = perturbed_old(current)
        batch.ref_logprobs = batch.old_logprobs - 0.05
    else:
        batch.rollout_logprobs = (perturbed_old(current, seed=7) - current) * 0.05 * batch.loss_mask + current
        gap = {k: float(v) for k, v in rollout_logprob_metrics(batch.rollout_logprobs, current, batch.loss_mask).items()}
        batch.old_logprobs = {"exact": current, "as_rollout": batch.rollout_logprobs}.get(old)
        batch.ref_logprobs = current - 0.05
    if stream:  # each mini-batch its own call, as trainer.stream_minibatches trains them, joined as it does
        from dapo_megatron.driver.metrics import join_parts
        mini = config.ppo_mini_batch_size * 2
        parts = [batch.select(list(range(i, min(i + mini, len(batch))))) for i in range(0, len(batch), mini)]
        metrics = [join_parts([actor.update(p, new_step=not k) for k, p in enumerate(parts)])]
    else:
        metrics = [actor.update(batch) for _ in range(steps)]
    return {"metrics": metrics, "logprobs": everywhere(actor.compute_logprobs(batch))["logprobs"],
            "before": before, "weights": export_weights(actor.chunks), "lr": config.optim.lr,
            "state": state_bytes(actor), "distributed_optimizer": config.optim.use_distributed_optimizer,
            "hf_dir": hf_dir, "gap": gap}


def refusals(hf_dir: str, parallel: dict, batch: RolloutBatch) -> list[str]:
    """The errors of updates without old log-probs where the update is not exactly on-policy:
    two mini-batches, two epochs, `actor.old_logprobs=recompute`."""
    from dapo_megatron.train.actor import Actor
    out = []
    for over in (dict(ppo_mini_batch_size=2), dict(ppo_epochs=2), dict(old_logprobs="recompute")):
        actor = Actor(actor_config(parallel, **over), hf_dir, n=2)
        batch = batch.select(list(range(len(batch))))
        batch.ref_logprobs = everywhere(actor.compute_logprobs(batch))["logprobs"]
        try:
            actor.update(batch)
            out.append("")
        except ValueError as e:
            out.append(str(e))
    return out


def state_bytes(actor) -> dict:
    """What Megatron allocated on this rank after an update: bytes of the parameters' storages
    (DDP's param buffers under the distributed optimizer), the main-grad buffers and the optimizer
    state (storages not already counted), and the rank's coordinates (plan/state.py predicts them)."""
    import dataclasses

    from dapo_megatron.parallel import coords
    from dapo_megatron.train.offload import Offloader, main_grads, optimizer_tensors
    params = lambda: [p for c in actor.chunks for p in c.parameters()]  # noqa: E731 (no module buffers)
    groups = {"params": params, "grads": main_grads(actor.chunks), "optimizer": optimizer_tensors(actor.optimizer)}
    return {"bytes": Offloader(groups, None).nbytes(), "coords": dataclasses.asdict(coords())}


def assert_same_weights(got: dict, want: dict, tol: float, what: str) -> None:
    """The weights `got` exports (a rank's share) agree with `want`'s to `tol`, except where
    Adam's eps decides. Its first step is lr * g / (|g| + 1e-8): lr * sign(g) where |g| is well
    above 1e-8, but a fraction of lr set by g itself where |g| is near 1e-8, so fp noise of 1e-9 in
    such a gradient moves the weight by ~lr / 10 between layouts (seen: 1.6e-5 on one lm_head element, TP2 vs
    TP1, on a VL batch). Weights `want` moved by less than lr / 2 are held to lr instead. Both are
    `run_updates` results from the same weights."""
    lr = want["lr"]
    for name, tensor in got["weights"].items():
        diff = (tensor - want["weights"][name]).abs()
        in_eps = (want["weights"][name] - want["before"][name]).abs() < lr / 2
        assert float(diff.masked_fill(in_eps, 0).max()) <= tol, f"{what}: {name}"
        assert float(diff.masked_fill(~in_eps, 0).max()) <= lr, f"{what}: {name} (gradient within Adam's eps)"


def layout_job(hf_dirs: list[str], parallel: dict, batch: RolloutBatch, max_tokens: int,
               update_dir: str | None, updates: list[dict], refuse: bool = False) -> dict:
    """Everything one layout checks: log-probs of each model, then one update per entry of
    `updates` (actor overrides) on `update_dir`, then (`refuse`) the `refusals`."""
    from dapo_megatron.train.parallel import init_parallel
    init_parallel(ParallelConfig(**parallel))
    out = {"logprobs": logprob_job(hf_dirs, parallel, batch, max_tokens, init=False)}
    # an update may name its own model (`hf_dir`): the plan's state check on other shapes
    out["updates"] = [run_updates(over.pop("hf_dir", update_dir), parallel, batch, over) for over in map(dict, updates)]
    out["refusals"] = refusals(update_dir, parallel, batch) if refuse else []
    return pack(out)


def _train_step(actor, step: int) -> dict:
    """One RL step on batch `step` (a different batch per step, old log-probs recomputed)."""
    batch = make_batch(seed=100 + step)
    batch.old_logprobs = perturbed_old(everywhere(actor.compute_logprobs(batch))["logprobs"], seed=step)
    batch.ref_logprobs = batch.old_logprobs - 0.05
    return actor.update(batch)


def _crashing_save(real_save):
    def save(*args, **kwargs):
        real_save(*args, **kwargs)  # the shards are written into the temp folder...
        raise RuntimeError("simulated crash during the save")  # ...and the process dies
    return save


def _load_damaged_copy(load, path: str) -> str:
    """The error of `load` (a callable of the path) on a copy of `path` with one bit flipped in a .distcp."""
    import glob
    import shutil
    import tempfile
    from dapo_megatron.train import checkpoint as ckpt
    from dapo_megatron.weights.hf_io import CheckpointError
    bad = os.path.join(tempfile.mkdtemp(), "step_2")
    shutil.copytree(path, bad)
    target = sorted(glob.glob(os.path.join(bad, "*.distcp")))[0]
    data = bytearray(open(target, "rb").read())
    data[len(data) // 2] ^= 1
    open(target, "wb").write(bytes(data))
    try:
        load(bad)
    except CheckpointError as e:
        return str(e)
    finally:
        shutil.rmtree(os.path.dirname(bad))
    return "loaded without an error"


def _exiting_save(real_save):
    def save(*args, **kwargs):
        real_save(*args, **kwargs)
        os._exit(3)  # killed after writing the shards, before the rename and `latest`
    return save


RESUME_OPTIM = dict(lr=1e-3, lr_warmup_steps=2, lr_scheduler="cosine", min_lr=1e-4)


def resume_job(hf_dir: str, parallel: dict, root: str, phase: str) -> bytes:
    """phase "train": steps 1-2, save, step 3 (the uninterrupted reference), then a save of step
    3 that crashes mid-write. phase "resume": fresh processes load `latest`, run step 3.
    phase "reshard": load into this (different) layout, weights only, and compute log-probs."""
    import megatron.core.dist_checkpointing as dcp
    from dapo_megatron.train import checkpoint as ckpt
    from dapo_megatron.train.actor import Actor
    from dapo_megatron.train.parallel import init_parallel
    init_parallel(ParallelConfig(**parallel))
    actor = Actor(actor_config(parallel, optim=RESUME_OPTIM, max_tokens_per_microbatch=64), hf_dir, n=2,
                  total_steps=6)
    out = {}
    if phase == "train":
        out["metrics"] = [_train_step(actor, 1), _train_step(actor, 2)]
        ckpt.save_checkpoint(actor, root, 2, {"step": 2, "sampler": [7, 8]}, keep=2, hf_files=(hf_dir, None))
        out["logprobs_after_2"] = everywhere(actor.compute_logprobs(make_batch(seed=0)))["logprobs"]
        out["metrics"].append(_train_step(actor, 3))
        out["logprobs_after_3"] = everywhere(actor.compute_logprobs(make_batch(seed=0)))["logprobs"]
        real, dcp.save = dcp.save, _crashing_save(dcp.save)
        try:
            ckpt.save_checkpoint(actor, root, 3, {"step": 3}, keep=2)
        except RuntimeError as e:
            out["crash"] = str(e)
        finally:
            dcp.save = real
        return pack(out)
    path = ckpt.resolve_resume("auto", root)
    out["path"] = path
    if phase == "resume":
        out["trainer_state"] = ckpt.load_checkpoint(actor, path)
        out["metrics"] = [_train_step(actor, 3)]
        out["logprobs_after_3"] = everywhere(actor.compute_logprobs(make_batch(seed=0)))["logprobs"]
        return pack(out)
    out["damaged_error"] = _load_damaged_copy(lambda bad: ckpt.load_checkpoint(actor, bad), path)
    out.update(_start_from(hf_dir, parallel, path, actor))
    try:
        ckpt.load_checkpoint(actor, path)
    except ValueError as e:
        out["optimizer_error"] = str(e)
    out["trainer_state"] = ckpt.load_checkpoint(actor, path, load_optimizer=False)
    out["logprobs_after_2"] = everywhere(actor.compute_logprobs(make_batch(seed=0)))["logprobs"]
    # Last: a save killed mid-write (os._exit, no clean-up runs). Results go to a file first.
    with open(os.path.join(root, "reshard_result.pt"), "wb") as f:
        f.write(pack(out))
    dcp.save = _exiting_save(dcp.save)
    ckpt.save_checkpoint(actor, root, 5, {"step": 5}, keep=1)
    return pack({})  # not reached


def _start_from(hf_dir: str, parallel: dict, path: str, hf_actor) -> dict:
    """model.load_checkpoint = `path`, as a training rank's setup does it: an actor built without
    the HF weights and an (offloading) reference, both loaded by `load_start`. Their log-probs, those
    of `hf_actor` (model.path's weights), the start's LR step and Adam state; a damaged copy's error."""
    from dapo_megatron.train import checkpoint as ckpt
    from dapo_megatron.train.actor import Actor
    from dapo_megatron.train.reference import Reference
    batch = make_batch(seed=0)
    out = {"hf_logprobs": everywhere(hf_actor.compute_logprobs(batch))["logprobs"]}
    start = Actor(actor_config(parallel, optim=RESUME_OPTIM, max_tokens_per_microbatch=64), hf_dir, n=2,
                  total_steps=6, load_weights=False)
    ref = Reference(RefConfig(parallel=ParallelConfig(**parallel)), hf_dir, max_tokens_per_microbatch=64)
    ckpt.load_start(path, start, ref)
    out["start_logprobs"] = everywhere(start.compute_logprobs(batch))["logprobs"]
    out["start_ref_logprobs"] = everywhere(ref.compute_logprobs(batch))["logprobs"]
    out["start_lr_steps"] = start.scheduler.num_steps
    out["start_adam_state"] = sum(len(o.state) for o in ckpt._torch_optimizers(start.optimizer))
    out["start_damaged_error"] = _load_damaged_copy(lambda bad: ckpt.load_start(bad, start), path)
    return out


def _training_state(actor) -> list:
    """Every tensor of the actor's training state, found by walking Megatron's own objects (DDP's
    flat buffers, the parameters and their main grads, the distributed optimizer's shards, Adam's
    state) rather than the offloader's group tables: what an offload must release."""
    out = []
    for chunk in actor.model:  # not `actor.chunks`: it refuses while the params are offloaded
        for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            out += [t for t in (buffer.param_data, buffer.grad_data) if t is not None]
        for p in chunk.parameters():
            out += [p] + ([p.main_grad] if getattr(p, "main_grad", None) is not None else [])
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for name in ("shard_fp32_from_float16_groups", "shard_fp32_groups", "shard_float16_groups"):
            out += [t for group in getattr(opt, name, None) or [] for t in group if t is not None]
        out += [v for s in opt.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return out


def offload_job(hf_dir: str, parallel: dict, dtype: str, root: str) -> bytes:
    """Two identical actors take the same two steps; between them one offloads its params, grads
    and optimizer state to host memory and loads them back. Returns both actors' weights, optimizer
    state and step-2 metrics, what the offloaded storages held while offloaded, the error of an
    update attempted while offloaded, and the log-probs of an offloading and a resident reference.
    Then Megatron's CPU optimizer (actor.optim.cpu_offload): `cpu_optimizer_steps`."""
    from dapo_megatron.train.actor import Actor
    from dapo_megatron.train.offload import GROUPS, optimizer_tensors
    from dapo_megatron.train.parallel import init_parallel
    from dapo_megatron.train.reference import Reference
    init_parallel(ParallelConfig(**parallel))
    config = dict(optim=dict(use_distributed_optimizer=True), max_tokens_per_microbatch=64)
    kept, moved = (Actor(actor_config(parallel, **dict(config, optim=dict(config["optim"]))), hf_dir, n=2,
                         dtype=dtype) for _ in range(2))
    out = {"metrics": [[_train_step(a, 1)] for a in (kept, moved)], "state": state_bytes(kept)}
    moved.offload(list(GROUPS))
    out["held"] = {g: [s.nbytes() for s in moved.offloader.held(g)] for g in GROUPS}
    state = _training_state(moved)
    out["state_tensors"] = len(state)
    out["unreleased"] = [(tuple(t.shape), t.dtype) for t in state if t.untyped_storage().nbytes()]
    try:
        _train_step(moved, 2)
    except RuntimeError as e:
        out["offloaded_error"] = str(e)
    moved.onload(list(GROUPS))
    for a, m in zip((kept, moved), out["metrics"]):
        m.append(_train_step(a, 2))
    out["weights"] = [export_weights(a.chunks) for a in (kept, moved)]
    out["optimizer"] = [[t.detach().clone() for t in optimizer_tensors(a.optimizer)()] for a in (kept, moved)]
    batch = make_batch(seed=3)
    refs = [Reference(RefConfig(parallel=ParallelConfig(**parallel), offload=off), hf_dir, dtype=dtype,
                      max_tokens_per_microbatch=64) for off in (False, True)]
    out["ref_held"] = [s.nbytes() for s in refs[1].offloader.held("params")]
    out["ref_logprobs"] = [everywhere(r.compute_logprobs(batch))["logprobs"] for r in refs]
    out["ref_held_after"] = [s.nbytes() for s in refs[1].offloader.held("params")]
    out["cpu_optimizer"] = cpu_optimizer_steps(hf_dir, parallel, dtype, root, config)
    return pack(out)


def cpu_optimizer_steps(hf_dir: str, parallel: dict, dtype: str, root: str, config: dict) -> dict:
    """An actor on Megatron's CPU optimizer takes step 1, is saved, takes step 2; a fresh one
    loads the save and takes step 2. Returns both step-2 weights, the moments saved and loaded,
    the distributed optimizer's master slots and the hybrid optimizer's inner optimizers."""
    from dapo_megatron.train import checkpoint as ckpt
    from dapo_megatron.train.actor import Actor

    def make():
        return Actor(actor_config(parallel, **dict(config, optim=dict(config["optim"], cpu_offload=True))), hf_dir,
                     n=2, dtype=dtype)

    def moments(actor):
        return [s[k].clone() for o in actor.optimizer.chained_optimizers for s in o.optimizer.state.values()
                for k in ("exp_avg", "exp_avg_sq")]
    saved, loaded = make(), make()
    out = {"metrics": [_train_step(saved, 1)]}
    ckpt.save_checkpoint(saved, root, 1, {"step": 1}, keep=1)
    ckpt.load_checkpoint(loaded, os.path.join(root, "step_1"))
    out["moments"] = [moments(a) for a in (saved, loaded)]
    out["metrics"] += [_train_step(a, 2) for a in (saved, loaded)]
    out["weights"] = [export_weights(a.chunks) for a in (saved, loaded)]
    inner = [o.optimizer for o in saved.optimizer.chained_optimizers]
    out["inner"] = [(type(o).__name__, len(o.cpu_optimizers), o.gpu_optimizer is None) for o in inner]
    out["device_masters"] = [m for o in saved.optimizer.chained_optimizers
                             for g in o.shard_fp32_from_float16_groups for m in g]
    return out
