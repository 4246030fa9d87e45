"""assets/vl.py: the tiny vision-language bundle loads offline in transformers, with the vision
tokens at the config's ids and the experts in the official checkpoint layout (vLLM's)."""
from __future__ import annotations

import json

import pytest
import torch

from dapo_megatron.assets.models import TINY_VL_MOE


@pytest.fixture(scope="module")
def vl_dir(tiny_vl_model):
    return tiny_vl_model


def test_processor_loads_offline_with_the_vision_tokens(vl_dir):
    from dapo_megatron.device.vision import load_processor
    processor = load_processor(str(vl_dir))
    tok = processor.tokenizer
    for key, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                       ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
        assert tok.convert_tokens_to_ids(token) == TINY_VL_MOE[key]
        assert tok.encode(token, add_special_tokens=False) == [TINY_VL_MOE[key]]
    assert len(tok) <= TINY_VL_MOE["text_config"]["vocab_size"]
    ip, vc = processor.image_processor, TINY_VL_MOE["vision_config"]
    assert (ip.patch_size, ip.temporal_patch_size, ip.merge_size) == (
        vc["patch_size"], vc["temporal_patch_size"], vc["spatial_merge_size"])
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
                                   tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>" in text
    # The image processor alone (the driver's and the engine's) is the processor's, and makes the same pixels.
    from PIL import Image

    from dapo_megatron.device.vision import load_image_processor, pixel_inputs
    alone = load_image_processor(str(vl_dir))
    assert type(alone) is type(ip) and alone.to_dict() == ip.to_dict()
    image = Image.effect_noise((70, 45), 40).convert("RGB")
    (p1, g1), (p2, g2) = pixel_inputs(alone, [image]), pixel_inputs(ip, [image])
    assert torch.equal(p1, p2) and g1.tolist() == g2.tolist() and p1.shape[0] == int(g1.prod())


def test_checkpoint_layout_and_config(vl_dir):
    from safetensors import safe_open
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
    config = json.loads((vl_dir / "config.json").read_text())
    text = config["text_config"]
    assert text["norm_topk_prob"] is True and text["tie_word_embeddings"] is config["tie_word_embeddings"] is False
    E, H, I = (TINY_VL_MOE["text_config"][k] for k in ("num_experts", "hidden_size", "moe_intermediate_size"))
    with safe_open(str(vl_dir / "model.safetensors"), "pt") as f:
        prefix = "model.language_model.layers.0.mlp.experts."
        assert f.get_slice(prefix + "gate_up_proj").get_shape() == [E, H, 2 * I]  # official, vLLM's
        assert f.get_slice(prefix + "down_proj").get_shape() == [E, I, H]
    torch.manual_seed(0)
    fresh = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(**TINY_VL_MOE)).float().state_dict()
    loaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(vl_dir), dtype=torch.float32).state_dict()
    assert all(torch.equal(fresh[k], loaded[k]) for k in fresh)  # transformers reads it back exactly


def test_the_driver_counts_prompt_images_with_the_models_processor(vl_dir, tmp_path):
    """driver/setup: a VL model's data set counts each image as the tokens it expands to (the
    processor's grid / merge^2); a text model gets no counter; a VL dir without its processor
    config is one error naming the key."""
    import shutil

    import numpy as np
    from PIL import Image

    from dapo_megatron.config.errors import ConfigError
    from dapo_megatron.driver.setup import image_token_counter
    from dapo_megatron.models import ModelSpec
    spec = ModelSpec.from_pretrained(str(vl_dir))
    count = image_token_counter(spec, str(vl_dir), "model.path")
    images = (Image.fromarray(np.zeros((64, 96, 3), dtype=np.uint8)), Image.fromarray(np.zeros((32, 32, 3), np.uint8)))
    assert count(images) == [6 * 4, 2 * 2]  # 8-pixel patches merged 2x2: (64/16) x (96/16), (32/16) x (32/16)
    text_spec = ModelSpec.from_hf(dict(TINY_VL_MOE["text_config"], model_type="qwen3_moe"))
    assert image_token_counter(text_spec, str(vl_dir), "model.path") is None
    broken = tmp_path / "no_processor"
    shutil.copytree(vl_dir, broken)
    (broken / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="model.tokenizer_path .*no_processor: cannot load the image processor"):
        image_token_counter(spec, str(broken), "model.tokenizer_path")


def test_what_an_export_copies_loads_the_same_processor(vl_dir, tmp_path):
    """A training checkpoint's hf/ folder and `convert mcore-to-hf`'s export take the model's files
    through copy_hf_files: a VL model's processor config among them (was: left behind, so that
    neither vLLM nor AutoProcessor loaded the export)."""
    from dapo_megatron.device.vision import load_processor
    from dapo_megatron.weights.hf_io import copy_hf_files
    copy_hf_files(str(vl_dir), str(tmp_path / "hf"))
    assert not (tmp_path / "hf" / "model.safetensors").exists()  # the weights are the converter's to write
    copied, original = load_processor(str(tmp_path / "hf")), load_processor(str(vl_dir))
    assert copied.image_processor.to_dict() == original.image_processor.to_dict()
    assert copied.tokenizer.chat_template == original.tokenizer.chat_template
