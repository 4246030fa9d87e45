"""Checkpoint utilities: `verify` (Megatron vs HF logits) and `inspect` (names, shapes, layout)."""
