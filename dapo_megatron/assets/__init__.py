"""Offline tiny assets: a ChatML BPE tokenizer, warmed-up tiny Qwen2 / Qwen3-MoE checkpoints and
the addition task's data, built locally (no hub) and addressed in configs as tiny://NAME."""
from dapo_megatron.assets.build import build_assets, default_asset_dir, resolve_asset_path

__all__ = ["build_assets", "default_asset_dir", "resolve_asset_path"]
