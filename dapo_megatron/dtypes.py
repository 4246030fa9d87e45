"""The dtype vocabulary, written once: our name (model.dtype, `--dtype`) -> torch, vLLM and HF.

One dtype serves trainer and engines (the weight sync moves tensors without casts), so every
place that names one reads this table: config validation, the verl translation, the engine's
`dtype`, Megatron's `params_dtype`, and the converter's config.json.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DType:
    name: str  # ours: model.dtype, convert --dtype
    torch: torch.dtype
    vllm: str  # vLLM EngineArgs(dtype=...)
    hf: str  # config.json "dtype" (transformers 5) / "torch_dtype" (transformers 4)
    aliases: tuple[str, ...]  # other spellings accepted from verl (`dtype=bfloat16`) and HF configs


DTYPES: dict[str, DType] = {row.name: row for row in (
    DType("fp32", torch.float32, "float32", "float32", ("float32", "float")),
    DType("bf16", torch.bfloat16, "bfloat16", "bfloat16", ("bfloat16",)),
    DType("fp16", torch.float16, "float16", "float16", ("float16", "half")),
)}
# Every accepted spelling (lower case) -> its row.
BY_ANY_NAME: dict[str, DType] = {n: row for row in DTYPES.values() for n in (row.name, row.hf, *row.aliases)}
