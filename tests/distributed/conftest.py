"""Tiny HF checkpoints shared by the distributed tests (built once per session, offline)."""
import pytest


@pytest.fixture(scope="session")
def tiny_hf_models(tmp_path_factory):
    from dapo_megatron.assets.models import build_tiny_model
    root = tmp_path_factory.mktemp("tiny_hf")
    specs = {"moe": ("qwen3_moe", 509, False), "qwen2_tied": ("qwen2", 509, True),
             "qwen2_untied": ("qwen2", 512, False), "qwen3": ("qwen3", 512, False)}
    return {name: build_tiny_model(kind, str(root / name), vocab_size=vocab, tie_word_embeddings=tied, seed=i)
            for i, (name, (kind, vocab, tied)) in enumerate(specs.items())}
