"""`python -m dapo_megatron.main --config-name <name> [key=value ...]`: run DAPO training.

Overrides use our keys (`actor.clip_ratio_high=0.28`) or verl's (`actor_rollout_ref.actor.
clip_ratio_high=0.28`), translated by one table. Bad input exits with code 2 and one line naming
the key or path to change.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import warnings
from typing import Optional, Sequence

from dapo_megatron.config import ConfigError, DapoConfig, check_path, load_config
from dapo_megatron.logs import LOGS
from dapo_megatron.weights.hf_io import CheckpointError

EXIT_BAD_INPUT = 2
EXIT_ROLE_DIED = 1  # a role died and trainer.max_restarts allowed no (more) restarts

# Python modules each part needs -> the install step that provides them.
REQUIRED_MODULES = {
    "megatron.core": "megatron-core (a core dependency)",
    "ray": "ray (a core dependency)",
    "vllm": "vllm: the cpu / gpu / npu extra (Ascend: vllm + vllm-ascend, docs/recipes/qwen3-30b-a3b.md)",
}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dapo_megatron.main",
        description="DAPO RL post-training with Megatron-Core and vLLM.",
        epilog="examples:\n"
               "  python -m dapo_megatron.main --config-name quickstart\n"
               "  python -m dapo_megatron.main --config-name qwen3_30b_a3b_megatron_gpu trainer.nnodes=4\n"
               "  python -m dapo_megatron.main --config-name dapo actor_rollout_ref.rollout.n=16  (verl keys)\n"
               "configs live in configs/*.yaml; every key is typed in dapo_megatron/config/schema.py",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config-name", "-cn", default="dapo", help="a YAML file in configs/ (without .yaml)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", help="key=value overrides (ours or verl-style)")
    return p.parse_args(argv)


def check_inputs(cfg: DapoConfig) -> None:
    """Paths that must exist. The rules that need the model's shape run once the model path is
    resolved (`driver/setup.prepare`, before Ray starts) and exit the same way."""
    if not cfg.model.path:
        raise ConfigError("model.path", "model.path is empty; set it to an HF checkpoint directory")
    check_path("model.path", cfg.model.path)
    for key in ("train_files", "val_files"):
        for path in getattr(cfg.data, key):
            check_path(f"data.{key}", path)


def missing_modules() -> list[str]:
    return [hint for mod, hint in REQUIRED_MODULES.items() if importlib.util.find_spec(mod.split(".")[0]) is None]


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"  # ours name the key; the source line says nothing to a user


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config_name, args.overrides)
        check_inputs(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.print_config:
        from omegaconf import OmegaConf
        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        return 0
    missing = missing_modules()
    if missing:
        print("error: this Python lacks " + "; ".join(missing) + ". Run `bash launch/setup_env.sh`.",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    from dapo_megatron.data.dataset import DataError
    from dapo_megatron.driver.supervisor import run
    from dapo_megatron.roles import RoleDied, StartFailed
    try:
        return run(cfg)
    # Bad input found once the run reads it (model, data, reward function, a checkpoint to resume
    # from): one line. A remote actor's error carries its traceback; its cause is the message.
    except (ConfigError, CheckpointError, DataError) as exc:
        print(f"error: {getattr(exc, 'cause', None) or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # Restarts spent (trainer.max_restarts): what died is the message. A role that did not start
    # (vLLM refused its arguments): its reason and the keys, as bad input.
    except (RoleDied, StartFailed) as exc:
        print(f"error: {exc}\nlibrary output of the training ranks and engines: "
              f"{os.path.join(cfg.trainer.default_local_dir, LOGS)}/", file=sys.stderr)
        return EXIT_BAD_INPUT if isinstance(exc, StartFailed) else EXIT_ROLE_DIED
    except BaseException:
        # The traceback names the failing role; what its libraries printed is in the run folder.
        print(f"library output of the training ranks and engines: {os.path.join(cfg.trainer.default_local_dir, LOGS)}/",
              file=sys.stderr)
        raise


if __name__ == "__main__":
    warnings.formatwarning = _one_line_warning  # the command's console; callers of main() keep theirs
    sys.exit(main())
