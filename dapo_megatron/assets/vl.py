"""The tiny vision-language bundle: one self-contained HF dir that transformers (`AutoProcessor`,
`Qwen3VLMoeForConditionalGeneration`) and vLLM both load offline.

It holds the random-init tiny Qwen3-VL-MoE (`models.TINY_VL_MOE`, official checkpoint layout), the
project's tiny tokenizer learnt to 500 tokens plus Qwen-VL's vision tokens at the ids the config
names (500-503), a chat template that renders image parts as
`<|vision_start|><|image_pad|><|vision_end|>`, and the image processor config matching the vision
tower: 8x8 patches, 2 frames per temporal patch, 2x2 merge, so one image token covers 16x16 pixels.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from dapo_megatron.assets.models import TINY_VL_MOE, build_tiny_vl_model
from dapo_megatron.assets.tokenizer import VISION_TOKENS, VL_BASE_VOCAB_SIZE, VL_CHAT_TEMPLATE, build_tokenizer, \
    special_token_ids

_VISION = TINY_VL_MOE["vision_config"]
_PIXELS_PER_TOKEN = (_VISION["patch_size"] * _VISION["spatial_merge_size"]) ** 2  # 256
# Images are resized to between 4 and 256 image tokens (32x32 .. 256x256 pixels): small enough
# for CPU tests, large enough that two images of different sizes get different grids.
MIN_PIXELS, MAX_PIXELS = 4 * _PIXELS_PER_TOKEN, 256 * _PIXELS_PER_TOKEN

PREPROCESSOR_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor",  # the PIL one without torchvision: device/vision.py
    "processor_class": "Qwen3VLProcessor",
    "patch_size": _VISION["patch_size"], "temporal_patch_size": _VISION["temporal_patch_size"],
    "merge_size": _VISION["spatial_merge_size"],
    "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],  # Qwen3-VL's
    "do_convert_rgb": True, "resample": 3,  # bicubic
}


def build_vl_assets(out_dir: str | os.PathLike, *, seed: int = 0) -> Path:
    """Build the bundle into `out_dir` (model, tokenizer, chat template, preprocessor config)."""
    out = Path(out_dir)
    build_tiny_vl_model(str(out), seed=seed)
    tokenizer = build_tokenizer(str(out), vocab_size=VL_BASE_VOCAB_SIZE, chat_template=VL_CHAT_TEMPLATE,
                                added_tokens=VISION_TOKENS)
    want = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
            "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
    got = {key: tokenizer.convert_tokens_to_ids(token) for key, token in want.items()}
    if got != {key: TINY_VL_MOE[key] for key in want}:
        raise AssertionError(f"vision token ids {got} differ from TINY_VL_MOE's")
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    from transformers import GenerationConfig
    ids = special_token_ids(tokenizer)
    GenerationConfig(bos_token_id=ids["bos_token_id"], pad_token_id=ids["pad_token_id"],
                     eos_token_id=[ids["eos_token_id"], ids["pad_token_id"]]).save_pretrained(str(out))
    return out
