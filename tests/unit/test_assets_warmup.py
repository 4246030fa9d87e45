"""The supervised warm-up: it lowers the loss, is deterministic, and the accuracy probe scores right."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo_megatron.assets.warmup import (IGNORE_INDEX, sample_responses, sampled_accuracy, supervised_batch,
                                         supervised_warmup)
from dapo_megatron.data import synthetic

PAIRS = synthetic.addition_pairs()[:16]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets / "tokenizer")


def test_supervised_batch_masks_the_prompt(tokenizer):
    input_ids, labels = supervised_batch(tokenizer, [(3, 4), (9, 9)])
    assert input_ids.shape == labels.shape == (2, 32 + 6)  # "\boxed{18}<|im_end|>" is 6 tokens
    assert (labels[:, :32] == IGNORE_INDEX).all()
    assert tokenizer.decode(labels[1, 32:]) == "\\boxed{18}<|im_end|>"
    assert tokenizer.decode(labels[0, 32:37]) == "\\boxed{7}<|im_end|>" and labels[0, 37] == IGNORE_INDEX


def test_warmup_lowers_loss_deterministically(tiny_assets, tokenizer):
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_assets / "qwen3_moe")
        losses = supervised_warmup(model, tokenizer, PAIRS, steps=8, batch_size=16, lr=1e-3, seed=5)
        runs.append((losses, model.lm_head.weight.detach().clone()))
    (losses, weight), (losses2, weight2) = runs
    assert losses == losses2 and torch.equal(weight, weight2)
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0], losses


def test_stop_callback_ends_early(tiny_assets, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_assets / "qwen2")
    calls = []
    losses = supervised_warmup(model, tokenizer, PAIRS, steps=50, batch_size=4, seed=0, check_every=2,
                               stop=lambda: calls.append(1) or len(calls) == 2)
    assert len(losses) == 4 and len(calls) == 2


class Echo(torch.nn.Module):
    """A stand-in LM that always emits a fixed continuation, to check the scoring rule."""
    def __init__(self, tokens: list[int], vocab: int):
        super().__init__()
        self.tokens, self.vocab = tokens, vocab

    def forward(self, input_ids, past_key_values=None, use_cache=True):
        cache = past_key_values or Counter()
        step, cache.step = cache.step, cache.step + 1
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], self.vocab), -1e9)
        logits[:, -1, self.tokens[min(step, len(self.tokens) - 1)]] = 0.0
        return type("Out", (), {"logits": logits, "past_key_values": cache})


class Counter:
    """Stands in for the KV cache: counts the decoding steps."""
    step = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        pass


def test_sampled_accuracy_scores_the_last_boxed(tokenizer):
    tokens = tokenizer.encode("\\boxed{9}<|im_end|>", add_special_tokens=False)
    model = Echo(tokens, len(tokenizer))
    assert sampled_accuracy(model, tokenizer, [(4, 5), (2, 7), (1, 1)], samples_per_pair=2) == pytest.approx(2 / 3)
    prompts = torch.zeros((1, 3), dtype=torch.long)
    out = sample_responses(model, prompts, samples_per_prompt=2, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, max_new_tokens=8, temperature=1.0,
                           generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 8) and out[0, :len(tokens)].tolist() == tokens
    assert (out[:, len(tokens):] == tokenizer.pad_token_id).all()
