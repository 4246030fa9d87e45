"""Qwen3-VL pieces that need no process group: the interleaved MRoPE against HF's text rotary,
the [3, B, S] positions of a micro-batch, and what ModelSpec reads from a VL config (the
Megatron-vs-HF logits are tests/distributed/test_vl_model.py)."""
from types import SimpleNamespace

import torch

from dapo_megatron.assets.models import TINY_VL_MOE
from dapo_megatron.models import ModelSpec
from dapo_megatron.models.qwen3_vl import InterleavedMRoPE, mrope_position_ids, vl_inputs

IMAGE = TINY_VL_MOE["image_token_id"]


def _spec() -> ModelSpec:
    from transformers import Qwen3VLMoeConfig
    return ModelSpec.from_hf(Qwen3VLMoeConfig(**TINY_VL_MOE))


def test_spec_reads_the_vl_fields_and_text_models_keep_their_defaults():
    spec = _spec()
    assert (spec.model_type, spec.hidden_size, spec.num_experts, spec.moe_ffn_hidden_size) == ("qwen3_vl_moe", 160, 4, 96)
    assert spec.mrope_section == (6, 5, 5) and spec.image_token_id == IMAGE and spec.deepstack_layers == 2
    assert spec.vision_config["spatial_merge_size"] == 2 and not spec.tie_word_embeddings
    text = ModelSpec.from_hf(dict(model_type="qwen3_moe", vocab_size=8, hidden_size=4, num_hidden_layers=1,
                                  num_attention_heads=1))
    assert (text.mrope_section, text.image_token_id, text.vision_config, text.deepstack_layers) == ((), None, None, 0)


def test_interleaved_mrope_is_hf_text_rotary():
    from transformers import Qwen3VLMoeConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextRotaryEmbedding
    text = Qwen3VLMoeConfig(**TINY_VL_MOE).text_config
    positions = torch.randint(0, 400, (3, 2, 50))  # [3, B, S]: T, H and W differ
    cos, sin = Qwen3VLMoeTextRotaryEmbedding(text)(torch.zeros(1, dtype=torch.float32), positions)  # [B, S, D]
    emb = InterleavedMRoPE(text.head_dim, 10000.0)(positions, [6, 5, 5])  # [S, B, 1, D]
    assert emb.shape == (50, 2, 1, 32)
    torch.testing.assert_close(emb.cos()[:, :, 0].transpose(0, 1), cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(emb.sin()[:, :, 0].transpose(0, 1), sin, rtol=0, atol=1e-6)


def test_positions_text_only_and_text_after_an_image():
    spec = _spec()
    text = torch.arange(10).expand(2, 10)
    assert torch.equal(mrope_position_ids(text, None, spec), torch.arange(10).expand(3, 2, 10))
    # 3 text tokens, a 1 x 4 x 6 patch grid = 2 x 3 image tokens (merge 2), then 4 response tokens.
    tokens = torch.tensor([[1, 2, 3] + [IMAGE] * 6 + [4, 5, 6, 7]])
    pos = vl_inputs(SimpleNamespace(tokens=tokens, pixel_values=torch.zeros(24, 384),
                                    image_grid_thw=torch.tensor([[1, 4, 6]])), "cpu", spec)["position_ids"]
    assert pos.shape == (3, 1, 13)
    assert pos[:, 0, 3:9].tolist() == [[3] * 6, [3, 3, 3, 4, 4, 4], [3, 4, 5, 3, 4, 5]]  # T, H, W of the grid
    assert pos[:, 0, 9:].tolist() == [[6, 7, 8, 9]] * 3  # text resumes after the image's largest position


def test_an_image_token_sampled_in_the_response_is_text():
    """A response may sample the image token id: the engine embeds and positions it as text, so
    must the trainer (only prompt positions, `prompt_lens`, hold images). HF's get_rope_index
    would look for a grid it does not have."""
    spec = _spec()
    prompt = [1, 2, 3] + [IMAGE] * 6 + [4]
    micro = lambda response: SimpleNamespace(  # noqa: E731
        tokens=torch.tensor([prompt + response]), prompt_lens=torch.tensor([len(prompt)]),
        pixel_values=torch.zeros(24, 384), image_grid_thw=torch.tensor([[1, 4, 6]]))
    sampled, text = vl_inputs(micro([5, IMAGE, 6]), "cpu", spec), vl_inputs(micro([5, 7, 6]), "cpu", spec)
    assert torch.equal(sampled["position_ids"], text["position_ids"])
    assert sampled["image_mask"][0].tolist() == [False] * 3 + [True] * 6 + [False] * 4
