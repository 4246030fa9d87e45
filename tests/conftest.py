"""Shared test setup: no hub access, quiet tokenizers, and the tiny assets built once per session."""
from __future__ import annotations

import atexit
import contextlib
import os
import tempfile
from pathlib import Path

import pytest

# Set before anything imports huggingface_hub (it reads these once): a test that would download
# must fail, not hang or pass by luck on a machine with a warm hub cache.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# No test builds the tiny:// bundles where a user's runs find them (~/.cache; the text one is ~1
# min of warm-up): a config default a test left unset did, once on every fresh machine (the async
# run's val_files). tiny:// here resolves under a regular file, so such a build fails at once,
# naming it; tests of the resolution itself set $DAPO_MEGATRON_ASSETS to a temp dir of their own.
# Subprocesses and the Ray workers a test starts inherit it.
_NO_ASSETS = Path(tempfile.gettempdir()) / f"dapo-tests-pass-asset-paths-not-tiny-{os.getpid()}"
_NO_ASSETS.write_text("tests must not build the tiny:// assets: pass the fixtures' paths (tests/conftest.py)\n")
atexit.register(_NO_ASSETS.unlink, missing_ok=True)
os.environ["DAPO_MEGATRON_ASSETS"] = str(_NO_ASSETS / "tiny-v2")

# No warm-up: tests need real checkpoints of the right shapes, not a model that can add; the
# warm-up itself is tested on its own (tests/unit/test_assets_warmup.py).
TEST_ASSETS_WARMUP_STEPS = 0
TEST_ASSETS_SEED = 0


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: training steps on a busy 2-core machine ran 50x slower
    with 2 threads (spinning OpenMP)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> Path:
    """An asset dir (tokenizer/, qwen2/, qwen3_moe/, data/{train,val}.parquet, manifest.json).

    Use `tiny_assets / "qwen3_moe"` as a model path. Built with random-init models (no warm-up)
    into a session tmp dir, so it never touches the user's ~/.cache asset dir.
    """
    from dapo_megatron.assets.build import build_assets
    out = tmp_path_factory.mktemp("tiny-assets") / "assets"
    return build_assets(out, seed=TEST_ASSETS_SEED, warmup_steps=TEST_ASSETS_WARMUP_STEPS, log=lambda _msg: None)


@pytest.fixture(scope="session")
def shape_model(tmp_path_factory):
    """name -> HF dir of that TEST_SHAPES model, built on first use and shared by the session."""
    from dapo_megatron.assets.models import build_test_shape
    root, built = tmp_path_factory.mktemp("shapes"), {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = build_test_shape(name, str(root / name))
        return built[name]
    return get


# A folder the suite's two phases share (launch/run_tests.sh sets it, and removes it after): the
# tool task's bundle (~70 s of one core) is built there once, beside the unit phase, instead of in
# the end-to-end phase, which runs one test at a time.
SHARED_BUNDLES = "DAPO_TEST_BUNDLES"


# Collection imports every test module and what it imports (torch, transformers, Megatron,
# vLLM): the collector stays off meanwhile and that heap is frozen after (dapo_megatron/heap.py),
# so each full collection in the tests' run scans only what they made.
_collecting = contextlib.ExitStack()


def pytest_sessionstart(session):
    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput"):
        return  # xdist's controller: its workers collect
    from dapo_megatron import heap
    _collecting.enter_context(heap.start_up())


def pytest_collection_finish(session):
    _collecting.close()


def pytest_collection_modifyitems(config, items):
    """tests/unit runs on two xdist workers, each taking its share in this order: the slow tests
    first (longest first: the VL warm-up, ~3 min, started ~100 s in and ran alone at the end while
    the other worker sat idle for ~100 s), and last the tests that wait for the tool bundle built
    beside the phase (a worker blocked on its lock does nothing meanwhile). The other phases keep
    the files' order: their module fixtures (one run, asserted by many tests) hold it together."""
    unit = [i for i in items if Path(str(i.path)).parent.name == "unit"]
    if not unit:
        return

    def rank(item) -> int:
        if "tool_assets" in item.fixturenames:
            return 2
        return 0 if item.get_closest_marker("slow") else 1
    first = sorted(unit, key=rank)  # stable: the files' order within each rank
    rest = [i for i in items if Path(str(i.path)).parent.name != "unit"]
    items[:] = first + rest


# The session's local Ray: a start and a stop cost ~8 s of the two cores, ~12 modules and
# in-process runs used one each. Started on first use as a run starts its own
# (driver/placement.init_ray: its host environment, its CPUs for the largest user here: two
# engines beside the default data plane) and kept for the next module, with tests/e2e on its
# workers' path (test modules' engine stand-ins are imported by name). A module that needs a
# Ray of its own (a worker setup hook, set as Ray starts) shuts this one down; the next user
# starts it again. What a module starts on it, it stops: `local_ray` checks that each module
# finds every CPU free, and starts a fresh Ray (with a warning naming the leak) when not.
RAY_CPUS_FREE_WAIT_S = 30.0
_local_ray: dict = {}  # the GCS address of the Ray `local_ray` started


@pytest.fixture(scope="module")
def local_ray(request):
    ray = pytest.importorskip("ray")
    if ray.is_initialized() and ray.get_runtime_context().gcs_address != _local_ray.get("gcs"):
        ray.shutdown()  # a run's own (one started with no Ray up): not this session's CPUs and path
    if ray.is_initialized() and not _all_cpus_free(ray):
        import warnings
        warnings.warn(f"{request.module.__name__}: the session's Ray still holds CPUs taken before this module "
                      f"({ray.available_resources().get('CPU', 0):g} of {ray.cluster_resources().get('CPU', 0):g} "
                      "free): started afresh")
        ray.shutdown()
    if not ray.is_initialized():
        _start_local_ray()
        _local_ray["gcs"] = ray.get_runtime_context().gcs_address
    return ray


def _all_cpus_free(ray) -> bool:
    import time
    deadline = time.monotonic() + RAY_CPUS_FREE_WAIT_S  # actors killed a moment ago give theirs back
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0):
            return True
        time.sleep(0.2)
    return False


def _start_local_ray() -> None:
    from dapo_megatron.config import load_config
    from dapo_megatron.driver.placement import init_ray
    # A local Ray's processes inherit this process's environment as it starts: the run's (host
    # settings, the data plane's) and tests/e2e on the path reach them; the test process and
    # what it starts later keep their own, as when each module started a Ray of its own.
    saved = dict(os.environ)
    e2e = str(Path(__file__).parent / "e2e")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (e2e, saved.get("PYTHONPATH")) if p)
    try:
        # CPUs for the full layout's data plane too: test_data_plane starts one in the test process
        init_ray(load_config("quickstart", ["data_plane.storage_units=2", "trainer.layout=full"]))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def pytest_sessionfinish(session, exitstatus):
    _collecting.close()  # a collection that stopped early
    import gc
    gc.unfreeze()  # the exit's collection frees it (nanobind's leak check counted what it kept)
    import sys
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def in_pinned_process(function: str, **kwargs):
    """`module:function(**kwargs)` (JSON in and out) in a process started with the bundles' pinned
    CPU kernels (assets/kernels.py): what a build measured, measured again on the same kernels.
    (This process's kernels are its machine's own: a sampled token may round the other way.)"""
    from dapo_megatron.assets import kernels
    return kernels.call_pinned(function, kwargs, cwd=str(Path(__file__).parent.parent))


def build_tool_bundle(root) -> Path:
    """The tests' tool bundle in `root`/tools (a file lock: a second caller waits, then finds it)."""
    from dapo_megatron.assets.build import build_tool_assets
    return build_tool_assets(Path(root) / "tools", seed=TEST_ASSETS_SEED, log=lambda _msg: None, accuracy=False)


@pytest.fixture(scope="session")
def tool_assets(tmp_path_factory) -> Path:
    """The tool task's bundle (tokenizer/, qwen2/, data/), warmed up: the tests need a model that
    really calls the interpreter (~1 min once per suite; the same weights as the demo's bundle,
    without the manifest's accuracy figures). In $DAPO_TEST_BUNDLES when set (a bundle built
    there with other settings is an error, not reused), else in this session's temp dir."""
    return build_tool_bundle(os.environ.get(SHARED_BUNDLES) or tmp_path_factory.mktemp("tool-assets"))


@pytest.fixture(scope="session")
def tiny_vl_model(tmp_path_factory) -> Path:
    """The tiny Qwen3-VL-MoE bundle (`assets/vl.py`: model, tokenizer, processor config), built once
    per session. Read-only: a test that needs other weights builds its own."""
    from dapo_megatron.assets.vl import build_vl_assets
    return build_vl_assets(tmp_path_factory.mktemp("vl") / "qwen3_vl_moe", seed=0)


@pytest.fixture(scope="session")
def vl_tokenizer(tiny_assets, tmp_path_factory):
    """The tiny tokenizer with Qwen-VL's vision tokens (one id each) and a chat template that
    renders image parts, saved and reloaded so that `name_or_path` is a real directory."""
    from transformers import AutoTokenizer
    from dapo_megatron.assets.tokenizer import VL_CHAT_TEMPLATE
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets / "tokenizer")
    tokenizer.add_tokens(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"], special_tokens=True)
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("vl-tokenizer")
    tokenizer.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="session")
def geo3k_data(tmp_path_factory) -> Path:
    """geo3k-format data (train.parquet, test.parquet: 224 px figures, ~300-token prompts)."""
    from dapo_megatron.data.geo3k_synth import write_geo3k
    out = tmp_path_factory.mktemp("geo3k")
    write_geo3k(out, n_train=40, n_val=8, seed=TEST_ASSETS_SEED)
    return out
