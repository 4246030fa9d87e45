"""Megatron-Core 0.16.1 on a CPU with gloo: the patches that make it run, applied once per process.

Megatron-Core assumes CUDA in a few dozen places. Rather than forking it, `install()` patches the
spots we hit, each commented with the symptom it fixes (see notes/megatron-on-cpu.md). Only the
paths exercised by our tests are covered: model build, forward, weight load/export, distributed
checkpoints, TP / PP / EP (allgather dispatcher) with sequence parallel.
"""
from __future__ import annotations

import contextlib
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

from dapo_megatron.device import megatron_local_spec

_INSTALLED = False
_THREAD = threading.local()  # torch function modes are per thread
# Where Megatron's "cuda" tensors go: the host, or the meta device while a real shape is built
# (`cuda_on_meta`): DDP's buffers ask for torch.cuda.current_device() by name.
_TARGET = ["cpu"]


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Maps `device="cuda"` arguments to cpu, and reports cuda type names for cpu tensors.

    Symptoms: `torch.zeros(..., device="cuda")` in pipeline schedules, the optimizer's `.cuda()`,
    the default causal mask -> "Torch not compiled with CUDA enabled"; the mixed-precision and
    distributed optimizers ("Wrapped parameters must be one of torch.cuda.FloatTensor ...") and
    `clip_grads` (bare assertion) compare `tensor.type()` with 'torch.cuda.*Tensor' strings.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Symptom: "Wrapped parameters must be one of torch.cuda.FloatTensor" (DistributedOptimizer,
        # Float16 optimizer) and a bare assertion in clip_grads.py: they check `tensor.type()`
        # strings. Report the cuda type name for cpu tensors, and for a real shape's meta ones.
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args).replace("torch.meta.", "torch.", 1)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        if "device" in kwargs and (_is_cuda(kwargs["device"]) or isinstance(kwargs["device"], int)):
            kwargs = {**kwargs, "device": _TARGET[0]}
        # Symptom: "Cannot access accelerator device when none is available" from the CPU
        # optimizer's pinned host copies: with no device, host memory has nothing to pin for.
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.to and any(_is_cuda(a) for a in args[1:]):
            args = tuple(_TARGET[0] if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """Megatron's RNG tracker, keeping CPU generator states instead of CUDA ones.

    Symptom: `model_parallel_cuda_manual_seed` / `get_cuda_rng_tracker().fork()` raise
    "Torch not compiled with CUDA enabled" (they store `torch.cuda.get_rng_state()`).
    """

    def __init__(self, *args, **kwargs):
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = kwargs.get("is_inference_rng_tracker", False)
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _patch_torch_cuda() -> None:
    # Symptom: `torch.cuda.current_device()` in RoPE, the memory buffer, the router, mappings and
    # p2p asserts "Torch not compiled with CUDA enabled"; resolve the current device to cpu.
    torch.cuda.current_device = lambda: _TARGET[0]
    # Symptom: the same assertion from `torch.cuda.synchronize()` in checkpoint save and p2p.
    torch.cuda.synchronize = lambda *a, **k: None


class _HostStream:
    """A CUDA stream's and event's calls, on a host where everything runs in order."""

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None) -> "_HostStream":
        return self

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


def _patch_cpu_optimizer() -> None:
    """Megatron's CPU optimizer (actor.optim.cpu_offload) on a rank whose device is the host."""
    from megatron.core.optimizer import optimizer_config
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
    # Symptom: TypeError "'>=' not supported between NoneType and Version" from
    # is_te_min_version when the precision-aware optimizer is configured: TE is not installed.
    optimizer_config.is_te_min_version = lambda *a, **k: False
    # Symptom: "Torch not compiled with CUDA enabled": it copies on side streams and waits for them.
    torch.cuda.current_stream = lambda *a, **k: _HostStream()
    torch.cuda.Stream = _HostStream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    # Symptom: KeyError in _set_sub_optimizer_grads: it offloads only `param.is_cuda` parameters
    # and takes the rest as host ones without a device twin. Here the host is the device: each
    # parameter's host fp32 copy is its offloaded copy, as a CUDA rank's offload_fraction=1 pairs them.
    split = HybridDeviceOptimizer._get_sub_optimizer_param_groups

    def host_is_device(self, offload_fraction):
        cpu_groups, gpu_groups, to_copy, to_param, to_fp32 = split(self, offload_fraction)
        if not gpu_groups and not to_copy:
            for group in self.param_groups:
                for param in group["params"]:
                    copy = to_fp32.get(param, param)
                    to_copy[param], to_param[copy] = copy, param
        return cpu_groups, gpu_groups, to_copy, to_param, to_fp32
    HybridDeviceOptimizer._get_sub_optimizer_param_groups = host_is_device


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)
    # Symptom: full activation recompute (actor.recompute_granularity=full) raises "Torch not
    # compiled with CUDA enabled" in CheckpointFunction, which saves the device RNG state to
    # restore it for the recompute; on CPU the device generator is the CPU one.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    # Symptom: then the recompute itself raises it (the default causal mask on "cuda"): the
    # autograd engine runs the recompute without this thread's torch function mode.
    forward_again = mrandom.CheckpointFunction.backward

    def backward(ctx, *grads):
        with _CudaToCpuMode():
            return forward_again(ctx, *grads)
    mrandom.CheckpointFunction.backward = staticmethod(backward)


def _no_compile(model=None, **options):
    return model if model is not None else (lambda fn: fn)


def import_without_compile() -> None:
    """Import megatron-core with torch.compile as a no-op decorator (its `jit_fuser` stays one).

    Megatron decorates ~40 functions with `jit_fuser` (torch.compile) at import, and the first
    decoration imports inductor: 4-6 s of CPU for a run's two ranks here (bench/core_use.py). The
    one our models call, the router's `_apply_expert_bias`, is a no-op without expert bias (Qwen3
    has none); the others serve fusions and layers we do not use. Does nothing where megatron was
    imported before."""
    if "megatron.core" in sys.modules:
        return
    compile_ = torch.compile
    torch.compile = _no_compile
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = compile_


@contextlib.contextmanager
def cuda_on_meta():
    """Megatron's "cuda" tensors land on the meta device: the DDP buffers of a real shape built
    with no memory (plan/build.py). Host tensors go where torch's default device says."""
    _TARGET[0] = "meta"
    try:
        yield
    finally:
        _TARGET[0] = "cpu"


def install() -> None:
    """Apply the CPU patches to torch.cuda and megatron-core; idempotent.

    The module patches are process-wide, but torch function modes are thread-local: call
    install() again in any other thread that runs Megatron code (e.g. a threaded Ray actor).
    """
    global _INSTALLED
    if not _INSTALLED:
        import_without_compile()
        _patch_torch_cuda()
        _patch_rng()
        _patch_cpu_optimizer()
        megatron_local_spec.install()
        _INSTALLED = True
    if not getattr(_THREAD, "mode", None):
        _THREAD.mode = _CudaToCpuMode()
        _THREAD.mode.__enter__()  # stays on this thread's mode stack for its lifetime
