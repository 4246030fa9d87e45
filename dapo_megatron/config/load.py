"""Compose a YAML config + overrides with Hydra into a validated `DapoConfig`.

We use Hydra's compose API rather than `@hydra.main` so that bad input becomes one `ConfigError`
naming the key (with the nearest valid name for a typo) instead of a Hydra traceback, and so the
entry points keep their own `--help`.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
from pathlib import Path
from typing import Iterable

from dapo_megatron.config.errors import ConfigError
from dapo_megatron.config.schema import DapoConfig
from dapo_megatron.config.validate import validate
from dapo_megatron.config.verl_compat import translate_overrides

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
SCHEMA_NAME = "dapo_schema"


def schema_keys(cls=DapoConfig, prefix: str = "") -> dict[str, bool]:
    """Every dotted key of the schema -> whether it is a group (a nested dataclass)."""
    keys: dict[str, bool] = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        nested = f.default_factory if callable(f.default_factory) else None
        is_group = nested is not None and dataclasses.is_dataclass(nested)
        keys[key] = is_group
        if is_group:
            keys.update(schema_keys(nested, key + "."))
    return keys


def _unknown_key_error(key: str) -> ConfigError:
    known = schema_keys()
    parent = key.rpartition(".")[0]
    siblings = [k for k in known if k.rpartition(".")[0] == parent] or list(known)
    near = difflib.get_close_matches(key, siblings, n=1, cutoff=0.5) or difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean {near[0]}?" if near else ""
    return ConfigError(key, f"unknown config key {key!r}{hint}")


def hydra_appends(overrides: Iterable[str]) -> list[str]:
    """Hydra's `+key=value` adds a key and fails on one that exists; verl scripts use it on keys
    that exist in our schema, where it means `key=value`. Keys below a free-form dict
    (`rollout.engine_kwargs.*`) are added or replaced (`++`) with or without the `+`."""
    known, free = schema_keys(), tuple(d + "." for d in open_dicts())
    out = []
    for item in overrides:
        bare = item.lstrip("+")
        key = bare.partition("=")[0]
        if key.startswith(free):
            out.append("++" + bare)
        elif item.startswith("+") and not item.startswith("++") and key in known:
            out.append(bare)
        else:
            out.append(item)
    return out


def _keys_of_type(kinds: tuple[str, ...], cls=DapoConfig, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        if str(f.type).startswith(kinds):
            out.append(prefix + f.name)
        elif callable(f.default_factory) and dataclasses.is_dataclass(f.default_factory):
            out += _keys_of_type(kinds, f.default_factory, prefix + f.name + ".")
    return out


def list_keys() -> list[str]:
    """Keys of the schema's lists (`data.train_files`)."""
    return _keys_of_type(("List", "list"))


def scalar_lists(overrides: Iterable[str]) -> list[str]:
    """`data.train_files=a.parquet` means a list of one file, as in verl (its loaders take both)."""
    lists = set(list_keys())
    out = []
    for item in overrides:
        key, eq, value = item.partition("=")
        v = value.strip()
        wrap = eq and key.lstrip("+~") in lists and v and not v.startswith("[") and v.lower() not in ("null", "none")
        quoted = v if v[:1] in "'\"" else "'" + v + "'"  # quoted: `${oc.env:X}/a` is one string
        out.append(f"{key}=[{quoted}]" if wrap else item)
    return out


def open_dicts() -> list[str]:
    """Keys of the schema's free-form dicts (`rollout.engine_kwargs`): any key below them is valid."""
    return _keys_of_type(("Dict", "dict"))


def check_override_keys(overrides: Iterable[str]) -> None:
    known, free = schema_keys(), tuple(d + "." for d in open_dicts())
    for item in overrides:
        key = item.lstrip("+~").partition("=")[0]
        if key not in known and not key.startswith(free):
            raise _unknown_key_error(key)


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore
    ConfigStore.instance().store(name=SCHEMA_NAME, node=DapoConfig)


def available_configs(config_dir: Path = CONFIG_DIR) -> list[str]:
    return sorted(p.stem for p in Path(config_dir).glob("*.yaml"))


def _compose(config_name: str, overrides: list[str], config_dir: Path):
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException
    register_schema()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            return compose(config_name=config_name, overrides=overrides)
    except MissingConfigException:
        raise ConfigError("--config-name", f"no config named {config_name!r} in {config_dir}; "
                                           f"available: {', '.join(available_configs(config_dir))}") from None
    except (HydraException, OmegaConfBaseException) as exc:
        # Hydra sometimes chains the OmegaConf error and sometimes only quotes it in its message.
        cause = exc.__cause__ or exc
        quoted = re.search(r"full_key: (\S+)", str(exc))
        key = getattr(cause, "full_key", None) or (quoted.group(1) if quoted else None)
        if key and (isinstance(cause, ConfigKeyError) or "ConfigKeyError" in str(exc)):
            raise _unknown_key_error(key) from None
        key = key or config_name
        raise ConfigError(key, f"invalid value for {key} ({config_name}): {str(cause).splitlines()[0]}") from None


def load_config(config_name: str = "dapo", overrides: Iterable[str] = (), *, check: bool = True,
                config_dir: Path | str = CONFIG_DIR) -> DapoConfig:
    """YAML `configs/<config_name>.yaml` + overrides (ours or verl-style) -> a validated DapoConfig."""
    from omegaconf import OmegaConf
    overrides = scalar_lists(hydra_appends(translate_overrides(list(overrides))))
    check_override_keys(overrides)
    cfg = _compose(config_name, overrides, Path(config_dir))
    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as exc:  # interpolation or type errors surface here
        key = getattr(exc, "full_key", None) or config_name
        raise ConfigError(key, f"invalid value for {key}: {str(exc).splitlines()[0]}") from None
    return validate(obj) if check else obj


def load_run_config(path: str, overrides: Iterable[str] = ()) -> DapoConfig:
    """A run's resolved `<run dir>/config.yaml` (driver/setup.write_config) + overrides -> a
    validated DapoConfig: what `evaluate` starts from for a training checkpoint."""
    from omegaconf import OmegaConf
    overrides = scalar_lists(hydra_appends(translate_overrides(list(overrides))))
    check_override_keys(overrides)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(DapoConfig), OmegaConf.load(path),
                              OmegaConf.from_dotlist([o.lstrip("+") for o in overrides]))
        obj = OmegaConf.to_object(cfg)
    except Exception as exc:
        key = getattr(exc, "full_key", None) or path
        raise ConfigError(key, f"{path}: invalid value for {key}: {str(exc).splitlines()[0]}") from None
    return validate(obj)


def check_path(key: str, path: str) -> str:
    """A configured path must exist; `tiny://` paths are built on demand and pass."""
    if path.startswith("tiny://") or os.path.exists(path):
        return path
    raise ConfigError(key, f"{key}: path {path!r} does not exist")
