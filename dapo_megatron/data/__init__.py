"""Prompt data: verl-schema datasets (parquet / JSONL), the prompt sampler, the tiny addition task.

Import the modules directly (`dapo_megatron.data.dataset`, `.sampler`, `.synthetic`): this package
re-exports nothing, because assets/ imports `synthetic` while `dataset` imports assets/ (for
tiny:// paths), and eager re-exports here would make that an import cycle.
"""
