"""Rollout: vLLM engines behind the Engine protocol; the only package that imports vLLM.

Light imports only here: `types` and `checksum` load without vLLM, so the driver and the weights
side can use them; `engine` (imports vLLM) and `actor` (imports Ray) are imported explicitly:
    from dapo_megatron.rollout.engine import Engine
    from dapo_megatron.rollout.actor import engine_actor
"""
from dapo_megatron.rollout.checksum import (Checksum, checksum_mismatches, merge_checksums, shard_checksum,
                                            state_dict_checksums, tensor_checksum)
from dapo_megatron.rollout.types import FINISH_REASONS, RolloutGroup, Sampling

__all__ = ["Checksum", "checksum_mismatches", "merge_checksums", "shard_checksum", "state_dict_checksums",
           "tensor_checksum", "FINISH_REASONS", "RolloutGroup", "Sampling"]
