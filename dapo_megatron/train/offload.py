"""Training state to host memory and back, storage by storage (`actor.offload`, `ref.offload`).

Colocated placement shares each device between a training rank and an engine: while the engines
generate, the rank keeps what `actor.offload` names in host memory. Storages move, not tensors:
Megatron's parameters and main grads are views into flat DDP buffers, and the distributed
optimizer's fp32 shards of fp32 parameters are views of those, so each storage is copied once
and resized to 0 in place. Every view, and every reference the optimizer and DDP hold, stays
valid and sees the same bytes after `onload` (verl treats the DDP buffers the same way).

    stash = Offloader({"params": fn, "grads": fn, "optimizer": fn}, device, keep=("params", "optimizer"))
    stash.offload(["grads", "optimizer"])   # fn() lists a group's tensors at the time of the call
    stash.onload(["grads", "optimizer"])

A storage belongs to the first group (in the table's order) whose tensors use it. Groups not in
`keep` are freed without a copy and come back zeroed: the main grads are dead between an update
and the next one, which zeroes them first. Reading an offloaded tensor raises (its storage is
empty), it never returns stale bytes.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch

GROUPS = ("params", "grads", "optimizer")  # actor.offload's switches


class Offloader:
    def __init__(self, groups: dict[str, Callable[[], Iterable[torch.Tensor]]], device, keep: Iterable[str] = ()):
        self._groups, self._device, self._keep = groups, device, set(keep)
        self._held: dict[str, list[tuple[torch.UntypedStorage, torch.Tensor | None, int]]] = {}

    def _storages(self, name: str) -> list[torch.UntypedStorage]:
        """The storages of group `name`, each once, without those of earlier groups."""
        seen, out = set(), []
        for group, tensors in self._groups.items():
            for t in tensors():
                s = t.untyped_storage()
                if s._cdata in seen:  # the storage's identity; its data pointer is 0 while offloaded
                    continue
                seen.add(s._cdata)
                if group == name:
                    out.append(s)
            if group == name:
                return out
        raise KeyError(f"no offload group {name!r}; groups: {', '.join(self._groups)}")

    def offload(self, names: Iterable[str]) -> None:
        for name in names:
            if name in self._held:
                continue
            held = []
            for s in self._storages(name):
                host = None
                if name in self._keep:
                    host = self._device.host_buffer(s.nbytes())
                    host.untyped_storage().copy_(s)
                held.append((s, host, s.nbytes()))
                s.resize_(0)
            self._held[name] = held
        self._device.empty_cache()  # the caching allocator hands the freed blocks back

    def onload(self, names: Iterable[str]) -> None:
        for name in names:
            for s, host, nbytes in self._held.pop(name, []):
                s.resize_(nbytes)
                if host is None:
                    s.fill_(0)
                else:
                    s.copy_(host.untyped_storage())

    def nbytes(self) -> dict[str, int]:
        """Bytes of each group's storages (each storage counted once, in its first group)."""
        return {name: sum(s.nbytes() for s in self._storages(name)) for name in self._groups}

    def held(self, name: str) -> list[torch.UntypedStorage]:
        """The device storages of an offloaded group (empty while offloaded); [] when it is on the device."""
        return [s for s, _, _ in self._held.get(name, [])]

    @property
    def offloaded(self) -> list[str]:
        return list(self._held)

    @contextlib.contextmanager
    def onloaded(self):
        """Everything on the device for the block (a checkpoint save), offloaded again after it."""
        names = [n for n in self._groups if n in self._held]
        self.onload(names)
        try:
            yield
        finally:
            self.offload(names)


def module_tensors(chunks: list) -> Callable[[], list[torch.Tensor]]:
    """A group of every parameter and buffer of `chunks` (nn.Module's buffers: Megatron's DDP
    wrapper shadows `.buffers` with its list of flat parameter / grad buffers)."""
    return lambda: [t for c in chunks for t in list(c.parameters()) + list(torch.nn.Module.buffers(c))]


def main_grads(chunks: list) -> Callable[[], list[torch.Tensor]]:
    """A group of the DDP main-grad buffers (views of them: `param.main_grad`)."""
    return lambda: [p.main_grad for c in chunks for p in c.parameters() if getattr(p, "main_grad", None) is not None]


def optimizer_tensors(optimizer) -> Callable[[], list[torch.Tensor]]:
    """A group of a Megatron optimizer's state: the inner optimizers' parameters (the fp32 master
    copies where there are any; the model's own parameters belong to the params group) and their
    state (Adam's moments; empty before the first step)."""
    def tensors():
        out = []
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner = opt.optimizer
            out += [p for g in inner.param_groups for p in g["params"]]
            out += [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v)]
        return out
    return tensors
