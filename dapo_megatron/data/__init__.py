"""Prompt data: verl-schema datasets (parquet / JSONL), the prompt sampler, the tiny addition task,
rows with images (`images`: decoding, `<image>` placeholders) and a geo3k-format figure generator
(`geo3k_synth`).

Import the modules directly (`dapo_megatron.data.dataset`, `.sampler`, `.synthetic`): this package
re-exports nothing, so that assets/ (which builds the tiny task from `synthetic`) can import one
module without loading the others.
"""
