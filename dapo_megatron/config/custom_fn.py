"""A config key's `path/to/file.py:function` loaded: reward.custom_fn and rollout.tools' entries.

Here, below both roles that read such keys (reward/, toolcall/), so that neither reaches into
the other for it; errors name the key, the file and the function.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Callable

from dapo_megatron.config.errors import ConfigError


def load_custom_fn(spec: str, key: str = "reward.custom_fn") -> Callable:
    """`path/to/file.py:function` -> that function. Errors name the config key, file, function."""
    path_str, sep, name = spec.rpartition(":")
    if not sep or not path_str or not name:
        raise ConfigError(key, f"{key} must be 'path/to/file.py:function', got {spec!r}")
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise ConfigError(key, f"{key}: file {path} not found (resolved to {path.resolve()})")
    module_name = f"dapo_custom_{path.stem}_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses / pickling inside the file look it up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise ConfigError(key, f"{key}: importing {path} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        what = "not found" if fn is None else f"is a {type(fn).__name__}, not a function"
        raise ConfigError(key, f"{key}: {name!r} {what} in {path}; callables there: {found}")
    return fn
