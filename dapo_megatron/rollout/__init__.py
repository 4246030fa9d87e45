"""Rollout: vLLM engines behind the Engine protocol; the only package that imports vLLM.

Light imports only here: `types` loads without vLLM, so the driver can use it; `engine` (imports
vLLM) and `actor` (imports Ray) are imported explicitly:
    from dapo_megatron.rollout.engine import Engine      # Engine(EngineSpec.from_model(path, cfg.rollout))
    from dapo_megatron.rollout.actor import engine_actor
"""
from dapo_megatron.rollout.types import FINISH_REASONS, RolloutGroup, Sampling

__all__ = ["FINISH_REASONS", "RolloutGroup", "Sampling"]
