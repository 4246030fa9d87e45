"""device/vision.py: the vLLM plugin that runs Qwen-VL image processing on transformers' PIL
backend where torchvision is missing, its entry point, and the grids it computes.

The patching tests run in fresh interpreters: `install()` changes sys.modules for the process.
"""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dapo_megatron.device import vision

ROOT = Path(__file__).resolve().parents[2]
no_torchvision = pytest.mark.skipif(vision.torchvision_available(), reason="torchvision is installed: no-op case")


def _python(code: str, **env) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_no_op_where_torchvision_exists(monkeypatch):
    monkeypatch.setattr(vision, "torchvision_available", lambda: True)
    before = dict(sys.modules)
    assert vision.install() is False
    assert sys.modules.keys() == before.keys()


@no_torchvision
def test_install_points_the_torchvision_module_at_the_pil_processor():
    out = _python(
        "from dapo_megatron.device import vision\n"
        "assert vision.install() and vision.install()  # idempotent\n"
        "from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor, smart_resize\n"
        "from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil\n"
        "assert Qwen2VLImageProcessor is pil.Qwen2VLImageProcessorPil and smart_resize is pil.smart_resize\n"
        "from transformers.models.qwen3_vl import Qwen3VLProcessor\n"
        "assert 'video_processor' not in Qwen3VLProcessor.get_attributes()\n"
        "import vllm.model_executor.models.qwen3_vl_moe  # imported the torchvision module before\n"
        "print('ok')\n")
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_entry_point_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["vllm.general_plugins"]["dapo_megatron_vision"]
    module, function = target.split(":")
    assert module == vision.__name__ and getattr(vision, function) is vision.vllm_plugin


@pytest.mark.slow  # 30-40 s (two vLLM imports): handed out first with the other long ones (tests/conftest.py)
@no_torchvision
def test_vllm_model_inspection_subprocess_runs_the_plugin():
    """vLLM inspects a model class in a subprocess that only runs `load_general_plugins()`: the
    Qwen3-VL-MoE class imports there through the plugin, and fails with plugins disabled."""
    from importlib.metadata import entry_points
    if "dapo_megatron_vision" not in {e.name for e in entry_points(group="vllm.general_plugins")}:
        pytest.skip("the installed dapo-megatron metadata predates the entry point: pip install -e .")
    code = ("from vllm.model_executor.models.registry import ModelRegistry, _ModelInfo, _run_in_subprocess\n"
            "model = ModelRegistry.models['Qwen3VLMoeForConditionalGeneration']\n"
            "info = _run_in_subprocess(lambda: _ModelInfo.from_model_cls(model.load_model_cls()))\n"
            "assert info.supports_multimodal\n"
            "print('ok')\n")
    out = _python(code)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
    # With plugins disabled the same steps (plugins loaded, then the class) fail: run here, not
    # through the inspection subprocess (one vLLM import fewer, ~10 s).
    disabled = _python("from vllm.plugins import load_general_plugins\n"
                       "from vllm.model_executor.models.registry import ModelRegistry\n"
                       "load_general_plugins()\n"
                       "ModelRegistry.models['Qwen3VLMoeForConditionalGeneration'].load_model_cls()\n",
                       VLLM_PLUGINS="none")  # an allow-list naming no installed plugin
    assert disabled.returncode != 0 and "torchvision" in disabled.stderr, disabled.stderr[-3000:]


def test_image_grid_thw_matches_the_processor(tmp_path):
    import numpy as np
    from PIL import Image
    from dapo_megatron.assets.vl import MAX_PIXELS, PREPROCESSOR_CONFIG
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    processor = Qwen2VLImageProcessorPil(**{k: v for k, v in PREPROCESSOR_CONFIG.items()
                                             if k not in ("image_processor_type", "processor_class")})
    images = [Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8)) for h, w in ((40, 60), (90, 50), (5, 7),
                                                                                  (600, 900))]
    want = processor(images=images, return_tensors="np")["image_grid_thw"].tolist()
    assert vision.image_grid_thw(processor, images) == want
    assert vision.image_token_counts(processor, images) == [t * h * w // 4 for t, h, w in want]  # merge 2
    assert want[-1][1] * want[-1][2] * 64 <= MAX_PIXELS  # the large one was scaled down
