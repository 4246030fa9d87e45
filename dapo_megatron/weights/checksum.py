"""Per-tensor checksums that the trainer and the rollout engines compute the same way.

Torch only (no vLLM): the weights side imports this to checksum the HF-named tensors it sends,
the engine checksums the HF-named tensors it reads back from its live model, and the two dicts
are compared with `checksum_mismatches`. Both sides must pass tensors in HF names, HF layout and
the dtype the engine runs in.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

import torch

# Position weights cycle with this prime period: an int64 hash of the flat index, exact on every
# device, so a transposed, shifted or swapped block changes `weighted` even when `sum` does not.
_PERIOD = 65521
_MULT = 40503
# Elements per float64 chunk (bounds temporary memory). A multiple of the period, so every chunk
# starts at phase 0 and one cached weight vector serves them all.
_CHUNK = 64 * _PERIOD
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights_at(index: torch.Tensor) -> torch.Tensor:
    """Position weights of int64 flat indices, in [0.5, 1.5)."""
    return ((index % _PERIOD) * _MULT % _PERIOD).to(torch.float64) / _PERIOD + 0.5


def _position_weights(device: torch.device) -> torch.Tensor:
    if device not in _WEIGHTS:
        _WEIGHTS[device] = _weights_at(torch.arange(_CHUNK, device=device, dtype=torch.int64))
    return _WEIGHTS[device]


class Checksum(NamedTuple):
    sum: float  # float64 sum of the elements
    weighted: float  # float64 sum of element * position weight (weights in [0.5, 1.5))
    abs_sum: float  # float64 sum of |element|: the scale that tolerances are relative to
    numel: int


@torch.no_grad()
def tensor_checksum(t: torch.Tensor) -> Checksum:
    """Checksum of one tensor, order-sensitive; computed in float64 on the tensor's device."""
    flat = t.detach().reshape(-1)
    weights = _position_weights(flat.device)
    total = weighted = abs_total = 0.0
    for start in range(0, flat.numel(), _CHUNK):
        x = flat[start:start + _CHUNK].to(torch.float64)
        total += x.sum().item()
        weighted += torch.dot(x, weights[:x.numel()]).item()
        abs_total += x.abs().sum().item()
    return Checksum(total, weighted, abs_total, flat.numel())


@torch.no_grad()
def shard_checksum(t: torch.Tensor, full_shape: tuple[int, ...], dim: int, offset: int) -> Checksum:
    """Partial checksum of `t` = full.narrow(dim, offset, t.shape[dim]), a slice of a tensor of
    `full_shape` (a TP-sharded engine worker's piece). Position weights follow each element's
    flat index in the full tensor, so the partials of disjoint slices that cover it add up
    (`merge_checksums`) to its `tensor_checksum`, up to float64 rounding."""
    if tuple(t.shape) == tuple(full_shape):
        return tensor_checksum(t)
    strides = torch.empty(full_shape, device="meta").stride()
    rows = max(1, _CHUNK // max(1, t[0].numel()))  # blocks along dim 0 bound the index memory
    total = weighted = abs_total = 0.0
    for r0 in range(0, t.shape[0], rows):
        block = t[r0:r0 + rows].detach()
        index = torch.zeros((), dtype=torch.int64, device=t.device)
        for k, n in enumerate(block.shape):
            start = (r0 if k == 0 else 0) + (offset if k == dim else 0)
            view = [1] * block.dim()
            view[k] = n
            index = index + ((torch.arange(n, device=t.device) + start) * strides[k]).view(view)
        x = block.to(torch.float64)
        total += x.sum().item()
        weighted += (x * _weights_at(index)).sum().item()
        abs_total += x.abs().sum().item()
    return Checksum(total, weighted, abs_total, t.numel())


def merge_checksums(parts: Iterable[dict[str, Checksum]]) -> dict[str, Checksum]:
    """{hf_name: Checksum} of the full tensors from each worker's {hf_name: partial}: fields add
    up, so a missing or doubled slice shows as a wrong `numel` and sums."""
    merged: dict[str, Checksum] = {}
    for part in parts:
        for name, c in part.items():
            c = Checksum(*c)
            merged[name] = c if name not in merged else Checksum(*(a + b for a, b in zip(merged[name], c)))
    return merged


def state_dict_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Checksum]:
    """{hf_name: Checksum} of `(hf_name, tensor)` pairs, e.g. a state dict's `.items()` or a bucket."""
    return {name: tensor_checksum(t) for name, t in named_tensors}


def checksum_mismatches(expected: dict[str, Checksum], actual: dict[str, Checksum],
                        rtol: float = 1e-9) -> list[str]:
    """Names whose checksums differ, or that only one side has (sorted; empty: in sync).

    Sums are compared relative to `abs_sum`, since float64 sums taken in a different order
    (another device, chunking) differ by rounding only, far below any real weight change.
    """
    bad = sorted(set(expected) ^ set(actual))
    for name in sorted(set(expected) & set(actual)):
        a, b = Checksum(*expected[name]), Checksum(*actual[name])
        tol = rtol * max(a.abs_sum, b.abs_sum, 1e-30)
        if (a.numel != b.numel or abs(a.sum - b.sum) > tol or abs(a.weighted - b.weighted) > tol
                or abs(a.abs_sum - b.abs_sum) > tol):
            bad.append(name)
    return bad
