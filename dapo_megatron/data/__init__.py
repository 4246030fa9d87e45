"""Prompt data: verl-schema datasets (parquet / JSONL), the prompt sampler, the tiny addition task.

Import the modules directly (`dapo_megatron.data.dataset`, `.sampler`, `.synthetic`): this package
re-exports nothing, so that assets/ (which builds the tiny task from `synthetic`) can import one
module without loading the others.
"""
