"""Reading and writing HF safetensors checkpoints, one slice / one shard at a time.

Reading never materialises a whole checkpoint: `HFCheckpoint.read` opens each file once with
`safe_open` (memory-mapped) and copies out only the requested rows or columns. Writing produces
files of bounded size plus `model.safetensors.index.json`, the layout HF hub checkpoints use.
"""
from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor

import torch

INDEX = "model.safetensors.index.json"
_SYNC_EVERY = 256 << 20  # bytes written between background fdatasyncs of a shard file
SINGLE = "model.safetensors"


HF_SUBDIR = "hf"  # config + tokenizer files inside a Megatron checkpoint dir (what export needs)
MODEL_FILES = ("config.json", "generation_config.json")
# A vision-language model's processor: without it vLLM and AutoProcessor cannot load the export.
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json")


def copy_hf_files(model_dir: str, dst: str, tokenizer_dir: str | None = None) -> None:
    """The few kB an HF folder needs besides its weights: the model's config and generation config,
    a vision-language model's processor config, and the tokenizer (from `tokenizer_dir` when the
    model keeps none) with its chat template."""
    os.makedirs(dst, exist_ok=True)
    sources = [(model_dir, MODEL_FILES + PROCESSOR_FILES + TOKENIZER_FILES)]
    if tokenizer_dir:
        sources.append((tokenizer_dir, TOKENIZER_FILES))
    for src, names in sources:
        for name in names:
            if os.path.exists(os.path.join(src, name)):
                shutil.copy2(os.path.join(src, name), os.path.join(dst, name))


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


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}


class ShardWriter:
    """Writes (name, tensor) pairs into safetensors files of at most ~max_bytes each, streaming.

    A safetensors file is its header (names, dtypes, shapes, offsets) followed by the bytes, so
    a writer that must know every tensor before writing holds a whole file in memory (4 GB at
    the default --shard-mb). Here each tensor's bytes go straight to their place in the file,
    after `header_reserve` bytes kept for the header; `flush` writes the header there, padded
    with spaces (the format allows it), and fsyncs. A file also ends when its header would
    outgrow the reserve (thousands of tensors at the default 1 MiB).
    The output must be on disk before it is published, and the disk is slower than the export
    (~0.4-0.6 GB/s here): a background thread fdatasyncs every 256 MB, so the disk writes while
    the next tensors are produced instead of all at the final fsync.
    """

    def __init__(self, out_dir: str, prefix: str, max_bytes: int, header_reserve: int = 1 << 20):
        self.out_dir, self.prefix, self.max_bytes = out_dir, prefix, max_bytes
        self.header_reserve = (header_reserve + 7) // 8 * 8  # the data starts 8-byte aligned
        self.pending: dict[str, dict] = {}  # name -> header entry of the file being written
        self.pending_bytes = 0
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0
        self._out = None
        self._header_len = len(_header({}))
        self._unsynced = 0
        self._sync: Future | None = None
        self._syncer: ThreadPoolExecutor | None = None

    def _file(self) -> str:
        return f"{self.prefix}-{len(self.files):05d}.safetensors"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name}: dtype {tensor.dtype} has no safetensors name")
        nbytes = tensor.numel() * tensor.element_size()
        # the entry as it would be in this file: its offsets are an upper bound for a new file's
        entry = {"dtype": _ST_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                 "data_offsets": [self.pending_bytes, self.pending_bytes + nbytes]}
        grows = len(_header({name: entry})) - len(_header({}))  # its text and a comma
        if self.pending and (self.pending_bytes + nbytes > self.max_bytes
                             or self._header_len + grows > self.header_reserve):
            self.flush()
            entry["data_offsets"] = [0, nbytes]
        if self._header_len + grows > self.header_reserve:
            raise ValueError(f"tensor {name}: its header entry alone exceeds the {self.header_reserve}-byte "
                             "header reserve of a shard file")
        if self._out is None:
            self._out = open(os.path.join(self.out_dir, self._file()), "wb")
            self._out.seek(8 + self.header_reserve)
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._out.write(memoryview(data))
        self._unsynced += nbytes
        if self._unsynced >= _SYNC_EVERY and (self._sync is None or self._sync.done()):
            if self._sync is not None:
                self._sync.result()  # a failed sync raises here: a later fsync may not report it
            self._syncer = self._syncer or ThreadPoolExecutor(1, thread_name_prefix="shard-sync")
            self._sync, self._unsynced = self._syncer.submit(os.fdatasync, self._out.fileno()), 0
        self.pending[name] = entry
        self._header_len += grows
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        if self._syncer is not None:  # the fd must stay open until the thread is done with it
            self._syncer.shutdown()
            self._sync.result()
        header = _header(self.pending)
        header += b" " * (self.header_reserve - len(header))
        with self._out as out:
            out.seek(0)
            out.write(len(header).to_bytes(8, "little") + header)
            _sync(out)
        file = self._file()
        self.files.append(file)
        self.weight_map.update({k: file for k in self.pending})
        self.pending, self.pending_bytes, self._out = {}, 0, None
        self._header_len, self._sync, self._syncer, self._unsynced = len(_header({})), None, None, 0


def _header(entries: dict) -> bytes:
    return json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()


def _sync(f) -> None:
    """Flush and fsync: the caller renames the output folder into place, which must not
    publish files whose bytes are still only in the page cache."""
    f.flush()
    os.fsync(f.fileno())


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
        _sync(f)
