"""What the loop needs around a step: start-up, weight sync, save / resume, restarts."""
from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Optional

import ray

from dapo_megatron import dataplane, roles
from dapo_megatron.config import ConfigError, DapoConfig, check_model
from dapo_megatron.config.schema import DataConfig, SyncConfig
from dapo_megatron.data.dataset import PromptDataset
from dapo_megatron.driver.placement import Placement, beside_driver, init_ray, place
from dapo_megatron.logs import log_file
from dapo_megatron.models import ModelSpec
from dapo_megatron.roles import as_role
from dapo_megatron.rollout.manager import manager_actor
from dapo_megatron.train.checkpoint import resolve_resume, start_checkpoint_problem
from dapo_megatron.weights.checksum import checksum_mismatches
from dapo_megatron.weights.hf_io import CheckpointError
from dapo_megatron.weights.load import check_hf_checkpoint


@dataclass
class Context:
    cfg: DapoConfig
    model_path: str
    spec: ModelSpec
    tokenizer: object
    placement: Placement
    manager: object  # the RolloutManager actor: prompt stream, engines' requests, reward, validation, data plane
    out_dir: str
    total_steps: int

    @property
    def train(self):
        return self.placement.train

    @property
    def engines(self) -> list:
        return self.placement.engines


def _resolved(data: DataConfig) -> DataConfig:
    from dapo_megatron.assets import resolve_asset_path
    return dataclasses.replace(data, train_files=[resolve_asset_path(f) for f in data.train_files],
                               val_files=[resolve_asset_path(f) for f in data.val_files])


def check_memory(cfg: DapoConfig, spec: ModelSpec) -> None:
    """The memory plan, before Ray starts: a layout predicted not to fit one device is refused in
    one line naming the largest term's key (trainer.skip_memory_check=true: a warning instead).
    Nothing is checked where one device's memory is unknown: a CPU run without
    trainer.device_memory_gb, or a driver that cannot see the accelerators (a warning)."""
    from dapo_megatron import plan as memory_plan
    from dapo_megatron.device import detect
    if cfg.trainer.device_memory_gb <= 0 and (detect() if cfg.trainer.device == "auto" else cfg.trainer.device) == "cpu":
        return
    memory, flash = memory_plan.device_bytes(cfg)
    if memory is None:
        warnings.warn(f"memory plan: this host sees no {cfg.trainer.device} device; set trainer.device_memory_gb "
                      "to check the layout before the job starts")
        return
    try:
        memory_plan.check(memory_plan.make_plan(cfg, spec, memory, flash=flash))
    except ConfigError as exc:
        if not cfg.trainer.skip_memory_check:
            raise
        warnings.warn(f"{exc} (trainer.skip_memory_check=true: starting anyway)")


def prepare(cfg: DapoConfig) -> Context:
    """Resolve tiny:// assets, read the model spec (and check the config against it: the one
    place that does), load tokenizer and data, start Ray, place the roles (the training ranks
    build their state in `start`, once the engines gave the devices up)."""
    from transformers import AutoTokenizer

    from dapo_megatron.assets import resolve_asset_path
    from dapo_megatron.reward.manager import check_reward_config
    model_path = resolve_asset_path(cfg.model.path)
    try:
        spec = ModelSpec.from_pretrained(model_path)
        spec.arch  # noqa: B018  (an unsupported model_type fails here, naming the supported ones)
    except (OSError, ValueError) as exc:
        raise ConfigError("model.path", f"model.path {model_path}: {str(exc).splitlines()[0]}") from None
    check_model(cfg, spec)
    check_memory(cfg, spec)
    # Every input is read here, before Ray starts: a bad one is one line from main, not a
    # traceback from a remote actor minutes later.
    check_hf_checkpoint(model_path, spec)  # headers only: names, shapes, readable files (the engines load them)
    if cfg.model.load_checkpoint:
        problem = start_checkpoint_problem(cfg.model.load_checkpoint)
        if problem:
            raise ConfigError("model.load_checkpoint", f"model.load_checkpoint: {problem}")
    tokenizer_key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    tokenizer_dir = resolve_asset_path(cfg.model.tokenizer_path or cfg.model.path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise ConfigError(tokenizer_key, f"{tokenizer_key} {tokenizer_dir}: cannot load a tokenizer: "
                                         f"{str(exc).splitlines()[0]}") from None
    if not getattr(tokenizer, "chat_template", None):  # rows are chat messages: every one would fail
        raise ConfigError(tokenizer_key, f"{tokenizer_key} {tokenizer_dir}: the tokenizer has no chat template "
                                         f"(chat_template.jinja or tokenizer_config.json's chat_template)")
    tools = tool_schemas(cfg, tokenizer, tokenizer_key)
    image_tokens = image_token_counter(spec, tokenizer_dir, tokenizer_key)
    data = _resolved(cfg.data)
    train_data = PromptDataset.from_config(data, tokenizer, "train", tools=tools, image_tokens=image_tokens)
    val_data = (PromptDataset.from_config(data, tokenizer, "val", tools=tools, image_tokens=image_tokens)
                if data.val_files else None)
    total = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * max(
        1, len(train_data) // cfg.data.train_batch_size)
    check_reward_config(cfg.reward)  # imports reward.custom_fn: a bad one fails here, not in an actor
    init_ray(cfg)
    # The roles first; the manager starts the data plane while the others start (they attach to
    # it on first use, after the manager's first batch): their imports and the controller's overlap.
    handle = dataplane.Handle(cfg.data_plane.backend)
    placement = place(cfg, model_path, spec, cfg.data.max_prompt_length + cfg.data.max_response_length,
                      tokenizer_path=tokenizer_dir, data_plane=handle)
    manager = manager_actor().options(**beside_driver()).remote(
        _absolute_custom_fn(cfg), placement.engines, tokenizer_dir, handle, train_data, val_data, stop_token_ids(tokenizer),
        log_path=log_file(cfg.trainer.default_local_dir, "rollout-manager"), start_data_plane=True)
    return Context(cfg, model_path, spec, tokenizer, placement, manager, cfg.trainer.default_local_dir, total)


def restart_training(ctx: Context, cfg: DapoConfig) -> Context:
    """A restart that kept the other roles (driver/recovery.keep_roles): new training ranks in
    the dead ones' bundles, built by `start` once the kept engines sleep (the resume then syncs
    the checkpoint's weights into them)."""
    ctx.placement.train = ctx.placement.start_train()
    return dataclasses.replace(ctx, cfg=cfg)


def write_config(cfg: DapoConfig, out_dir: str) -> None:
    """The run's resolved config as <run dir>/config.yaml (written atomically): what the run was;
    `convert mcore-to-hf` names its model.path when a checkpoint lacks its hf/ folder."""
    from omegaconf import OmegaConf
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, ".config.yaml.tmp")
    with open(tmp, "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    os.replace(tmp, os.path.join(out_dir, "config.yaml"))


def _absolute_custom_fn(cfg: DapoConfig) -> DapoConfig:
    """reward.custom_fn's file as an absolute path: the reward worker may run in another directory."""
    path, sep, name = cfg.reward.custom_fn.rpartition(":")
    if not sep:
        return cfg
    reward = dataclasses.replace(cfg.reward, custom_fn=f"{os.path.abspath(os.path.expanduser(path))}:{name}")
    return dataclasses.replace(cfg, reward=reward)


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Where a validation answer ends: the tokenizer's eos and the chat template's end of turn."""
    return tuple(t for t in {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
                 if isinstance(t, int) and t >= 0)


def image_token_counter(spec, tokenizer_dir: str, key: str):
    """A vision-language model's prompts are counted with their images expanded (the engine's
    image processor sizes them: device/vision.py); None for a text model."""
    if not spec.is_vision_language:
        return None
    from dapo_megatron.device.vision import image_token_counts, load_image_processor
    try:
        processor = load_image_processor(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise ConfigError(key, f"{key} {tokenizer_dir}: cannot load the image processor of the vision-language "
                               f"model (preprocessor_config.json): {str(exc).splitlines()[0]}") from None
    return partial(image_token_counts, processor)


def tool_schemas(cfg: DapoConfig, tokenizer, tokenizer_key: str) -> list[dict] | None:
    """Multi-turn only: load rollout.tools here (a bad entry is one line before Ray starts), check
    the chat template renders tool messages, and return the schemas the prompts list."""
    if not cfg.rollout.multi_turn.enable:
        return None
    from dapo_megatron.toolcall import load_tools, tool_turn_ids
    tools = load_tools(cfg.rollout.tools)
    try:
        tool_turn_ids(tokenizer, ["check"])
    except Exception as exc:  # noqa: BLE001 - whatever the template does, the user changes the same key
        raise ConfigError(tokenizer_key, f"{tokenizer_key}: {exc}") from None
    return [t.schema for t in tools.values()]


def verify_due(cfg: DapoConfig, syncs: int) -> bool:
    every = cfg.rollout.sync.verify_every
    return every > 0 and syncs % every == 0


def sync_weights(train, engines: list, sync: SyncConfig, verify: bool, version: Optional[int] = None,
                 lost: Optional[list[int]] = None) -> dict:
    """Actor -> engines: pause, load every bucket, post-process, reset prefix cache, resume.

    With `verify`, per-tensor checksums of what each engine holds must equal what was sent; a
    mismatch stops training with the tensors' names (silent sync corruption is the failure that
    costs users the most). `version`: the policy version the engines record on every token they
    sample from now on (the driver's count of pushes). `lost`: engines (indices) that die in the
    sync are added to it and the others synced (the caller replaces them); None: such a death
    stops the sync (RoleDied). Returns {"sync/bytes": bytes sent per engine}.
    """
    def each(call) -> list:
        """`call` on every engine not lost, at once; their results (None for the lost)."""
        skip = set(lost or ())
        refs = [(i, None if i in skip else call(e)) for i, e in enumerate(engines)]
        out = []
        for i, ref in refs:
            try:
                out.append(None if ref is None else ray.get(ref))
            except ray.exceptions.RayActorError as exc:
                if lost is None:
                    raise roles.died("rollout engine", exc) from None
                lost.append(i)
                out.append(None)
        return out
    each(lambda e: e.begin_weight_update.remote())
    try:
        sent, nbytes, dead = as_role("actor", train.push_weights, engines, sync.bucket_mb, verify, sync.transport)
    finally:
        each(lambda e: e.finish_weight_update.remote(version))
    for i in dead:
        if lost is None:
            raise roles.died("rollout engine", f"engine {i} died in the weight sync")
        if i not in lost:
            lost.append(i)
    if verify:
        for i, held in enumerate(each(lambda e: e.checksums.remote())):
            bad = [] if held is None else checksum_mismatches(sent, held)
            if bad:
                raise RuntimeError(f"weight sync verification failed on engine {i}: {len(bad)} tensors differ "
                                   f"from the trainer's, e.g. {bad[:5]}")
    return {"sync/bytes": nbytes}


def trainer_state(run) -> dict:
    """Counters, and the manager's prompt position and sampler state: a resume continues the stream."""
    before = run.pending[0].step if run.pending else None  # untrained batches' prompts go back
    return {"step": run.step, "syncs": run.syncs,
            **roles.get("rollout manager", run.ctx.manager.state_dict.remote(before))}


def save(run) -> None:
    ctx = run.ctx
    path = as_role("actor", ctx.train.save, os.path.join(ctx.out_dir, "checkpoints"), run.step, trainer_state(run),
                   run.cfg.trainer.max_checkpoints_to_keep)
    run.checkpoint = path
    run.logger.plot_soon()
    print(f"saved {path}", flush=True)


def start(run) -> None:
    """A run's first moments, in the turns a step takes with the device (driver/colocate.py):
    the engines sleep, the ranks build (HF weights or model.load_checkpoint), a resume loads its
    checkpoint, the actor offloads around the sync that puts the loaded weights into the engines
    (also when sleeping at level 2 dropped theirs), and the engines wake for the first generation."""
    run.share.before_build(run)
    with run.timed("build"):
        as_role("actor", run.ctx.train.setup, run.ctx.total_steps)
    resumed = resume(run)
    loaded = resumed or ("start" if run.cfg.model.load_checkpoint or run.share.drops_weights else None)
    run.share.start(run, (lambda: _sync_loaded(run, loaded)) if loaded else None, resumed=bool(resumed))


def resume(run) -> Optional[str]:
    """trainer.resume_mode: auto (latest checkpoint if any), disable, or a step folder. Returns
    "resume" when a checkpoint was loaded (new engines hold the HF weights, kept ones later
    ones: `start` syncs the checkpoint's in), else None."""
    path = resolve_resume(run.cfg.trainer.resume_mode, os.path.join(run.ctx.out_dir, "checkpoints"))
    if path is None:
        return None
    run.share.before_resume(run)
    try:
        with run.timed("resume"):
            state = as_role("actor", run.ctx.train.load, path)
    except CheckpointError as exc:  # raised in a training rank; Ray wraps it with its traceback
        raise CheckpointError(str(getattr(exc, "cause", None) or exc)) from None
    run.step, run.syncs, run.checkpoint = state["step"], state["syncs"], path
    roles.get("rollout manager", run.ctx.manager.load_state_dict.remote(state))
    moved = run.logger.rewind(run.step)
    later = f"; the metrics of {moved} later steps (their weights were not saved) moved to " \
            f"metrics.discarded.jsonl" if moved else ""
    print(f"resumed from {path} at step {run.step}{later}", flush=True)
    return "resume"


def _sync_loaded(run, what: str) -> None:
    """The weights the ranks loaded (`what`: start or resume) into every engine, checksummed when
    rollout.sync.verify_every is on; the engines record the run's push count as their version."""
    with run.timed("sync", [what]), run.in_sync(what):
        sync_weights(run.ctx.train, run.ctx.engines, run.cfg.rollout.sync,
                     verify=run.cfg.rollout.sync.verify_every > 0, version=run.syncs)


def shutdown(run) -> None:
    # The roles stop while the last save's curves are drawn; plot() then draws only what that
    # drawing missed (nothing, at the end of a run).
    roles.get("rollout manager", run.ctx.manager.shutdown.remote())
    run.logger.plot()
    run.logger.close()
    ray.kill(run.ctx.manager)  # not in the placement group: removing it would leave the actor
    # Free the run's devices (its actors with them): a later run in the same process (a notebook,
    # a test session) finds Ray still up and would wait forever for a placement group of its own.
    run.ctx.placement.release()
