"""Reading and writing HF safetensors checkpoints, one slice / one shard at a time.

Reading never materialises a whole checkpoint: `HFCheckpoint.read` opens each file once with
`safe_open` (memory-mapped) and copies out only the requested rows or columns. Writing produces
files of bounded size plus `model.safetensors.index.json`, the layout HF hub checkpoints use.
"""
from __future__ import annotations

import json
import os

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(Exception):
    """A bad input checkpoint (missing / extra / misshapen tensor, unreadable file)."""


class HFCheckpoint:
    """The tensors of an HF checkpoint dir, read lazily and in slices."""

    def __init__(self, hf_dir: str):
        if not os.path.isdir(hf_dir):
            raise CheckpointError(f"HF checkpoint dir {hf_dir} does not exist")
        self.dir = hf_dir
        self._handles: dict = {}
        index = os.path.join(hf_dir, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                self.weight_map = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(hf_dir, SINGLE)):
            self.weight_map = {k: SINGLE for k in self.open_file(SINGLE).keys()}
        else:
            raise CheckpointError(f"{hf_dir} has neither {INDEX} nor {SINGLE}")

    def open_file(self, file: str):
        if file not in self._handles:
            from safetensors import safe_open
            path = os.path.join(self.dir, file)
            try:
                self._handles[file] = safe_open(path, framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"cannot read safetensors file {path}: {e}") from None
        return self._handles[file]

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def tensor_slice(self, name: str):
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name} is missing from {self.dir}")
        handle = self.open_file(self.weight_map[name])
        try:
            return handle.get_slice(name)
        except Exception as e:
            raise CheckpointError(f"tensor {name} not readable in {self.weight_map[name]}: {e}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensor_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Tensor `name`, or only rows/cols [start, end) of dimension `dim` (0 or 1)."""
        sl = self.tensor_slice(name)
        try:
            if dim is None:
                return sl[:]
            return sl[start:end] if dim == 0 else sl[:, start:end]
        except Exception as e:
            raise CheckpointError(f"tensor {name} in {self.weight_map[name]} is unreadable "
                                  f"(truncated file?): {e}") from None

    def close(self) -> None:
        self._handles.clear()


class ShardWriter:
    """Writes (name, tensor) pairs into safetensors files of at most ~max_bytes each."""

    def __init__(self, out_dir: str, prefix: str, max_bytes: int):
        self.out_dir, self.prefix, self.max_bytes = out_dir, prefix, max_bytes
        self.pending: dict = {}
        self.pending_bytes = 0
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        from safetensors.torch import save_file
        file = f"{self.prefix}-{len(self.files):05d}.safetensors"
        save_file(self.pending, os.path.join(self.out_dir, file), metadata={"format": "pt"})
        self.files.append(file)
        self.weight_map.update({k: file for k in self.pending})
        self.pending, self.pending_bytes = {}, 0


def finalize_shards(out_dir: str, weight_map: dict[str, str], total_bytes: int) -> None:
    """Rename the writers' files to model-0000i-of-0000N.safetensors and write the index."""
    files = sorted(set(weight_map.values()))
    renamed = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
    for old, new in renamed.items():
        os.replace(os.path.join(out_dir, old), os.path.join(out_dir, new))
    index = {"metadata": {"total_size": total_bytes},
             "weight_map": {k: renamed[weight_map[k]] for k in sorted(weight_map)}}
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump(index, f, indent=2)
