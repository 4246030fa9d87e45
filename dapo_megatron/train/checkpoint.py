"""Actor checkpoints on Megatron's `dist_checkpointing`: model + optimizer + LR schedule + RNG +
the driver's trainer state, published atomically.

    <root>/step_<N>/         a dist checkpoint (torch_dist) + rng/rank_<r>.pt + checksums.json
    <root>/latest            the name of the newest complete step folder, written last

A save writes into `<root>/.tmp-step_<N>`, renames it to `step_<N>` when every rank is done,
then replaces `latest` (write + rename), then prunes to the newest `keep` folders. A process
killed anywhere in between leaves the previous checkpoint and `latest` untouched. A load first
checks every file's size and CRC32 against checksums.json (`train/integrity.py`) and names the
first damaged one.

`load_start` (model.load_checkpoint) takes only the model weights of a dist checkpoint: a run's
start, not a resume.

Model weights reshard on load to any TP / PP / EP layout. The distributed optimizer's state is
saved in the `fully_reshardable` format; megatron-core 0.16.1 reloads it at the same layout and
across TP / PP changes, but not across EP changes: that load stops with a message naming
`load_optimizer=False`, which restores the weights, schedule and trainer state only.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from dapo_megatron.device import get_device
from dapo_megatron.train.integrity import check, write_manifest
from dapo_megatron.weights.hf_io import HF_SUBDIR, CheckpointError, copy_hf_files

_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
_PREFIX = "step_"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"{_PREFIX}{step}")


def latest_checkpoint(root: str) -> str | None:
    """The folder `latest` names, or None when there is no complete checkpoint."""
    try:
        with open(os.path.join(root, "latest")) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(root, name)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{root}/latest names {name!r}, which does not exist")
    return path


def resolve_resume(resume_mode: str, root: str) -> str | None:
    """trainer.resume_mode -> the checkpoint folder to load, or None to start fresh.

    auto: the newest checkpoint under `root` if any; disable: none; otherwise a step folder path.
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        return latest_checkpoint(root)
    if not os.path.isdir(resume_mode):
        raise FileNotFoundError(f"trainer.resume_mode={resume_mode!r} is not a checkpoint folder; "
                                "use auto, disable or the path of a step_<N> folder")
    return resume_mode


def _layout(actor) -> dict:
    p = actor.cfg.parallel
    return dict(tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=p.etp, world=dist.get_world_size(),
                distributed_optimizer=actor.cfg.optim.use_distributed_optimizer)


def _model_sharded_state_dict(chunks: list) -> dict:
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}  # VPP: as Megatron-LM names them


def _load_model(chunks: list, state: dict) -> None:
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state["model"] if len(chunks) == 1 else state[f"model{i}"])


def _sharded_state_dict(actor, *, is_loading: bool, with_optimizer: bool) -> dict:
    chunks = actor.chunks
    sd = _model_sharded_state_dict(chunks)
    if with_optimizer:
        _init_optimizer_state(actor.optimizer)  # no-op once the optimizer has stepped
        model_sd = {k: v for key in sd for k, v in sd[key].items()} if len(chunks) > 1 else sd["model"]
        sd["optimizer"] = actor.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                            metadata=_OPTIM_METADATA)
    return sd


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a Megatron (chained) optimizer."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in inner if getattr(o, "optimizer", None) is not None]


def _init_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer zero Adam state with a `step` (what torch Adam would create on its
    first step): 0.16.1's DistributedOptimizer state_dict() asserts one common step and fails on
    an optimizer that has not stepped yet (a load template, a save right after a weights-only
    load)."""
    for opt in _torch_optimizers(optimizer):
        # Megatron's CPU optimizer (actor.optim.cpu_offload) steps fp32 copies of the 16-bit
        # shards and keeps each copy in the state as `master_param`.
        masters = getattr(opt, "param_to_fp32_param", {})
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    main = masters.get(p, p)
                    opt.state[p].update(exp_avg=torch.zeros_like(main), exp_avg_sq=torch.zeros_like(main),
                                        step=torch.zeros((), dtype=torch.float32),
                                        **({"master_param": main} if p in masters else {}))


def _unshare_steps(optimizer) -> None:
    """0.16.1's load gives every param the same `step` tensor; torch Adam increments it in place
    once per param, so the bias correction drifts (seen: resumed loss off by 1.1e-3)."""
    for opt in _torch_optimizers(optimizer):
        for state in opt.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _load_optimizer(optimizer, state) -> None:
    """optimizer.load_state_dict, split so that torch Adam's per-param `step` survives.

    0.16.1's fully_reshardable loader copies every per-param state entry from the checkpoint,
    which has no `step` (KeyError: 'step'): load the param groups (and the common step) first,
    then the moments with `step` set aside, then put the steps back.
    """
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [state] if len(inner) == 1 else [v for _, v in sorted(state.items())]
    if len(states) != len(inner):
        raise ValueError(f"the checkpoint has {len(states)} optimizer states, this actor {len(inner)}; "
                         "load with load_optimizer=False")
    for opt, st in zip(inner, states):
        param_state = st.pop("param_state", None)
        kind = st.pop("param_state_sharding_type", None)
        opt.load_state_dict(st)
        if param_state is None:
            continue
        if kind != "fully_reshardable":
            raise ValueError(f"unsupported optimizer checkpoint format {kind!r}")
        steps = {p: s.pop("step") for p, s in opt.optimizer.state.items() if "step" in s}
        opt.load_parameter_state_from_fully_reshardable(param_state)
        for p, step in steps.items():
            opt.optimizer.state[p]["step"] = step


def _rng_state() -> dict:
    import random
    from megatron.core import tensor_parallel
    return {"python": random.getstate(), "device": get_device().rng_state(),
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    import random
    from megatron.core import tensor_parallel
    random.setstate(state["python"])
    get_device().set_rng_state(state["device"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def dist_save(sharded_state_dict: dict, path: str) -> None:
    """`dist_checkpointing.save` (synchronous, torch_dist) without megatron-core's result process.

    megatron-core 0.16.1's torch_dist writer returns its results through a
    `multiprocessing.Manager` that it starts with "spawn" on a process's first save: a fresh
    interpreter per rank, ~4 s of the 6 s that saving 1 GB took on our 2-core CPU. A synchronous
    save runs the writer in the calling process, so a plain queue carries the same results.
    (An async save, which we never use, runs the writer elsewhere and would need the Manager.)
    """
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if getattr(filesystem_async, "_results_queue", "absent") is None:  # unset, and the name exists
        filesystem_async._results_queue = queue.Queue()
    # Each tensor is written by torch.save, whose CRC32 of the bytes nothing ever reads: DCP's
    # load goes through torch.load, which does not check it (torch 2.13). Computing it took ~25%
    # of the save's CPU here; the callers' per-file manifest (`integrity`) is what a load checks.
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        dist_checkpointing.save(sharded_state_dict, path)
    finally:
        torch.serialization.set_crc32_options(crc)


def _prune(root: str, keep: int, protect: str) -> None:
    steps = sorted((int(n[len(_PREFIX):]), n) for n in os.listdir(root)
                   if n.startswith(_PREFIX) and n[len(_PREFIX):].isdigit())
    for _, name in steps[:-keep] if keep > 0 else []:
        if name != protect:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def save_checkpoint(actor, root: str, step: int, trainer_state: dict, *, keep: int = 2,
                    hf_files: tuple[str, str | None] | None = None) -> str:
    """Save the actor and `trainer_state` as `<root>/step_<step>`; collective over all ranks.

    `keep` (trainer.max_checkpoints_to_keep) newest step folders are kept; <= 0 keeps all.
    `hf_files`: (model dir, tokenizer dir or None) whose config, generation config, tokenizer and
    chat template go into `<step>/hf/`, so that `convert mcore-to-hf --ckpt <step>` needs no flag.
    """
    rank = dist.get_rank()
    final, tmp = step_dir(root, step), os.path.join(root, f".tmp-{_PREFIX}{step}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
        os.makedirs(tmp)
        if hf_files is not None:
            copy_hf_files(hf_files[0], os.path.join(tmp, HF_SUBDIR), hf_files[1])
    dist.barrier()
    sd = _sharded_state_dict(actor, is_loading=False, with_optimizer=True)
    sd.update(scheduler=actor.scheduler.state_dict(), trainer=trainer_state, layout=_layout(actor))
    dist_save(sd, tmp)
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.pt"))
    write_manifest(tmp)  # after a barrier: every rank has written its files, the folder is complete
    if rank == 0:
        _publish(tmp, final)
        _write_atomic(os.path.join(root, "latest"), os.path.basename(final))
        _prune(root, keep, protect=os.path.basename(final))
    dist.barrier()
    return final


def _publish(tmp: str, final: str) -> None:
    """Rename the finished temp folder into place (an existing folder of that step is replaced)."""
    if os.path.exists(final):
        old = f"{final}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def _check_optimizer_layout(saved: dict, now: dict, path: str) -> None:
    if saved["ep"] != now["ep"] or saved["distributed_optimizer"] != now["distributed_optimizer"]:
        raise ValueError(
            f"cannot restore the optimizer state of {path}: it was saved with ep={saved['ep']}, "
            f"distributed_optimizer={saved['distributed_optimizer']} and this run has ep={now['ep']}, "
            f"distributed_optimizer={now['distributed_optimizer']} (megatron-core 0.16.1 cannot reshard "
            "optimizer state across expert-parallel sizes or optimizer kinds). Load with "
            "load_optimizer=False to restore the model weights, LR schedule and trainer state only "
            "(Adam moments restart from zero), or resume with the saved layout.")


def _optimizer_classes() -> list:
    """Megatron's CPU optimizer keeps its inner optimizers' classes in its param groups, which go
    into the common state dict: torch.load (weights only) refuses those unless allowed by name."""
    from megatron.core import optimizer as mopt
    return list({torch.optim.AdamW, torch.optim.SGD, mopt.Adam, mopt.SGD})


def load_checkpoint(actor, path: str, *, load_optimizer: bool = True) -> dict:
    """Load `path` into the actor (resharding the weights to this layout); returns the trainer
    state saved with it. With `load_optimizer=False` the optimizer keeps its fresh state."""
    from megatron.core import dist_checkpointing
    try:
        check(path)
    except CheckpointError as e:
        raise CheckpointError(f"{e}. Resume from an earlier step_<N> folder with trainer.resume_mode=<its path>") from None
    with torch.serialization.safe_globals(_optimizer_classes()):
        common = dist_checkpointing.load_common_state_dict(path)
        if load_optimizer:
            _check_optimizer_layout(common["layout"], _layout(actor), path)
        template = _sharded_state_dict(actor, is_loading=True, with_optimizer=load_optimizer)
        state = dist_checkpointing.load(template, path)
    _load_model(actor.chunks, state)
    if load_optimizer:
        _load_optimizer(actor.optimizer, state["optimizer"])
        _unshare_steps(actor.optimizer)
    else:  # fp32 main params (bf16 / fp16 models) must follow the loaded weights
        actor.optimizer.reload_model_params()
    actor.scheduler.load_state_dict(common["scheduler"])
    rng = os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt")
    if common["layout"]["world"] == dist.get_world_size() and os.path.exists(rng):
        _set_rng_state(torch.load(rng, weights_only=False))
    return common["trainer"]


def start_checkpoint_problem(path: str) -> str | None:
    """Why `path` cannot start a run (model.load_checkpoint), or None: it must be a Megatron dist
    checkpoint folder, whose metadata.json names its format. Cheap, for the driver before Ray
    starts; the ranks' load checks every file (`integrity.check`)."""
    if not os.path.isdir(path):
        return f"{path} does not exist or is not a folder"
    if os.path.isfile(os.path.join(path, "latest")):
        return f"{path} holds a run's checkpoints; name one of its step_<N> folders"
    try:
        with open(os.path.join(path, "metadata.json")) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        backend = None
    if not backend:
        return (f"{path} is not a Megatron dist checkpoint (no metadata.json naming its format); an HF model "
                "folder goes in model.path")
    return None


def load_start(path: str, actor, ref=None) -> None:
    """model.load_checkpoint: the model weights of dist checkpoint `path` into the actor (and the
    reference, which is the start's policy), resharded to this layout. Weights only: the optimizer,
    LR schedule, RNG and trainer state stay fresh (a start, not a resume). Collective."""
    from megatron.core import dist_checkpointing
    try:
        check(path)
    except CheckpointError as e:
        raise CheckpointError(f"model.load_checkpoint: {e}") from None
    _load_model(actor.chunks, dist_checkpointing.load(_model_sharded_state_dict(actor.chunks), path))
    actor.optimizer.reload_model_params()  # fp32 main params (bf16 / fp16 models) follow the loaded weights
    if ref is not None:
        with ref.offloader.onloaded():
            _load_model(ref.chunks, dist_checkpointing.load(_model_sharded_state_dict(ref.chunks), path))
