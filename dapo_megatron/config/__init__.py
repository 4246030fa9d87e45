"""Typed configuration: schema, Hydra composition, verl translation, validation."""
from dapo_megatron.config.custom_fn import load_custom_fn
from dapo_megatron.config.errors import ConfigError
from dapo_megatron.config.load import available_configs, check_path, load_config, load_run_config, schema_keys
from dapo_megatron.config.schema import (ActorConfig, AlgorithmConfig, DapoConfig, DataConfig, ModelConfig,
                                         ParallelConfig, RefConfig, RewardConfig, RolloutConfig, TrainerConfig)
from dapo_megatron.config.validate import (check_lengths_fit, check_model, data_parallel_size, engine_arg_keys,
                                           num_engines, role_devices, validate)

__all__ = ["ConfigError", "DapoConfig", "DataConfig", "ModelConfig", "ActorConfig", "RefConfig",
           "RolloutConfig", "RewardConfig", "AlgorithmConfig", "TrainerConfig", "ParallelConfig",
           "load_config", "load_run_config", "validate", "check_model", "check_lengths_fit", "check_path", "schema_keys", "available_configs",
           "role_devices", "data_parallel_size", "num_engines", "load_custom_fn", "engine_arg_keys"]
