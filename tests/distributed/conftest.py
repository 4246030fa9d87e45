"""Tiny HF checkpoints shared by the distributed tests (built once per session, offline)."""
import pytest


@pytest.fixture(scope="session")
def tiny_hf_models(tmp_path_factory):
    from dapo_megatron.assets.models import TEST_SHAPES, build_tiny_model
    root = tmp_path_factory.mktemp("tiny_hf")
    specs = {"moe": ("qwen3_moe", 509, False, {}), "qwen2_tied": ("qwen2", 509, True, {}),
             "qwen2_untied": ("qwen2", 512, False, {}), "qwen3": ("qwen3", 512, False, {}),
             "a3b_like": TEST_SHAPES["a3b_like"]}  # 30B-A3B's ratios: hidden, FFN, expert FFN all differ
    return {name: build_tiny_model(kind, str(root / name), vocab_size=vocab, tie_word_embeddings=tied, seed=i, **shape)
            for i, (name, (kind, vocab, tied, shape)) in enumerate(specs.items())}
