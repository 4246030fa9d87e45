"""The run's roles built: placement, the rollout manager, the training ranks (prepare), and new
training ranks beside kept roles after a restart (restart_training)."""
from __future__ import annotations

import dataclasses
import os
import uuid
import warnings
from dataclasses import dataclass
from functools import partial

from transformers import AutoTokenizer

from dapo_megatron import dataplane
from dapo_megatron import plan as memory_plan
from dapo_megatron.assets import resolve_asset_path
from dapo_megatron.config import ConfigError, DapoConfig, check_model
from dapo_megatron.config.schema import DataConfig
from dapo_megatron.data.dataset import PromptDataset
from dapo_megatron.device import detect
from dapo_megatron.driver.placement import Placement, beside_driver, init_ray, place
from dapo_megatron.logs import log_file
from dapo_megatron.models import ModelSpec
from dapo_megatron.reward.manager import check_reward_config
from dapo_megatron.rollout.manager import manager_actor
from dapo_megatron.toolcall import load_tools, tool_turn_ids
from dapo_megatron.train.checkpoint import start_checkpoint_problem
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
    return dataclasses.replace(data, train_files=[resolve_asset_path(f) for f in data.train_files],
                               val_files=[resolve_asset_path(f) for f in data.val_files])


def check_memory(cfg: DapoConfig, spec: ModelSpec) -> None:
    """The memory plan, before Ray starts: a layout predicted not to fit one device is refused in
    one line naming the largest term's key (trainer.skip_memory_check=true: a warning instead).
    Nothing is checked where one device's memory is unknown: a CPU run without
    trainer.device_memory_gb, or a driver that cannot see the accelerators (a warning)."""
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
    # The lean layout hosts the data plane in the manager's process: clients find it by its name.
    host = f"rollout-manager-{uuid.uuid4().hex[:8]}" if cfg.trainer.lean else ""
    handle = dataplane.Handle(cfg.data_plane.backend, host=host)
    placement = place(cfg, model_path, spec, cfg.data.max_prompt_length + cfg.data.max_response_length,
                      tokenizer_path=tokenizer_dir, data_plane=handle)
    manager = manager_actor().options(**beside_driver(), **({"name": host} if host else {})).remote(
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
    tools = load_tools(cfg.rollout.tools)
    try:
        tool_turn_ids(tokenizer, ["check"])
    except Exception as exc:  # noqa: BLE001 - whatever the template does, the user changes the same key
        raise ConfigError(tokenizer_key, f"{tokenizer_key}: {exc}") from None
    return [t.schema for t in tools.values()]
