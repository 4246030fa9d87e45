"""A dist checkpoint's files, checked before a load: a size + CRC32 manifest written at save,
and a check that names the first damaged file.

torch_dist loads whatever it finds. A flipped byte in a .distcp becomes a wrong weight, since
torch.load does not read torch.save's CRC32. A missing or truncated file fails deep inside DCP
with one traceback per rank. CRC32 (zlib, ~3.5 GB/s on one core here) is for accidental damage
(disk, copy, transfer), not tampering.

    checksums.json   {"crc32": {"<relative path>": [bytes, "<crc32 hex>"], ...}}

A folder without the manifest (written by another tool, or before it existed) still gets the
structural check: Megatron's three metadata files exist and every byte range that `.metadata`
points at lies inside its file.
"""
from __future__ import annotations

import json
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor

from dapo_megatron.weights.hf_io import CheckpointError
from dapo_megatron.weights.load import agree_on_errors

MANIFEST = "checksums.json"
_REQUIRED = ("metadata.json", ".metadata", "common.pt")  # what megatron's torch_dist load opens
_BLOCK = 1 << 20  # fits in L2: crc32 re-reads the block from cache, not RAM (2x faster than 16 MiB here)
_WRITER = re.compile(r"(?:^|/)(?:__|rank_)(\d+)[_.]")  # __<rank>_<i>.distcp, rng/rank_<rank>.pt


def digest(path: str) -> tuple[int, str]:
    """(size in bytes, CRC32 as 8 hex digits) of a file, read in blocks."""
    crc, size, buf = 0, 0, bytearray(_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc, size = zlib.crc32(view[:n], crc), size + n
    return size, f"{crc:08x}"


def _digests(root: str, names: list[str], world: int) -> dict[str, tuple[int, str]]:
    """digest() of several files in threads (zlib and file reads release the GIL), this rank's
    share of the host's cores each."""
    threads = max(1, min(8, (os.cpu_count() or 1) // world, len(names)))
    with ThreadPoolExecutor(threads) as pool:
        return dict(zip(names, pool.map(lambda n: digest(os.path.join(root, n)), names)))


def _files(root: str) -> list[str]:
    out = []
    for folder, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(folder, n), root) for n in names]
    return sorted(f for f in out if f != MANIFEST)


def _share(files: list[str], rank: int, world: int) -> list[str]:
    """This rank's files: the ones a rank wrote (`__<rank>_*`, `rank_<rank>.*`) go to it, so they
    are read back from its own page cache; the rest round robin."""
    def owner(i, f):
        m = _WRITER.search(f)
        return int(m.group(1)) % world if m else i % world
    return [f for i, f in enumerate(files) if owner(i, f) == rank]


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj) -> list:
    import torch.distributed as dist
    if _rank_world()[1] == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def write_manifest(root: str) -> None:
    """Record the size and CRC32 of every file under `root`. Collective when a process group is
    up (each rank digests its share; rank 0 writes); called once every rank has written."""
    rank, world = _rank_world()
    _gather(None)  # a barrier: every rank's files are complete
    mine = _digests(root, _share(_files(root), rank, world), world)
    entries = {k: v for part in _gather(mine) for k, v in part.items()}
    if rank == 0:
        tmp = os.path.join(root, f".{MANIFEST}.tmp")
        lines = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(entries.items()))
        with open(tmp, "w") as f:
            f.write(f'{{"crc32": {{\n{lines}\n}}}}\n')  # a file per line
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, MANIFEST))
    _gather(None)


def check(root: str) -> None:
    """Raise CheckpointError naming the first damaged or missing file of dist checkpoint `root`.
    Collective when a process group is up (each rank reads its share; all raise the same)."""
    agree_on_errors(_check_share, root)


def _check_share(root: str) -> None:
    rank, world = _rank_world()
    try:
        problem = _structure(root)
        if problem is None and os.path.exists(os.path.join(root, MANIFEST)):
            problem = _checksums(root, rank, world)
    except OSError as e:
        problem = f"cannot read {e.filename or root}: {e.strerror or e}"
    if problem:
        raise CheckpointError(problem)


def _structure(root: str) -> str | None:
    if not os.path.isdir(root):
        return f"dist checkpoint {root} does not exist"
    for name in _REQUIRED:
        if not os.path.isfile(os.path.join(root, name)):
            return f"{os.path.join(root, name)} is missing: not a complete Megatron dist checkpoint"
    try:
        with open(os.path.join(root, "metadata.json")) as f:
            json.load(f)
    except ValueError as e:
        return f"{os.path.join(root, 'metadata.json')} is not valid JSON: {e}"
    if os.path.exists(os.path.join(root, MANIFEST)):
        return None  # the checksums cover the rest, and more
    return _storage_ranges(root)


def _storage_ranges(root: str) -> str | None:
    """Every (file, offset, length) that torch DCP's `.metadata` records lies inside its file."""
    from torch.distributed.checkpoint import FileSystemReader
    try:
        storage = FileSystemReader(root).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001  (a damaged pickle raises anything)
        return f"cannot read {os.path.join(root, '.metadata')}: {type(e).__name__}: {e}"
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            return f"{path} is missing (.metadata lists it)"
        if os.path.getsize(path) < end:
            return f"{path} has {os.path.getsize(path)} bytes and .metadata needs {end}: the file is truncated"
    return None


def _checksums(root: str, rank: int, world: int) -> str | None:
    with open(os.path.join(root, MANIFEST)) as f:
        try:
            want = json.load(f)["crc32"]
        except (ValueError, KeyError) as e:
            return f"{os.path.join(root, MANIFEST)} is damaged ({e}); delete it to load without checksums"
    for name in sorted(want):  # sizes first, on every rank: cheap, and a short file is the usual damage
        path, size = os.path.join(root, name), want[name][0]
        if not os.path.isfile(path):
            return f"{path} is missing ({MANIFEST} lists it)"
        if os.path.getsize(path) != size:
            return f"{path} has {os.path.getsize(path)} bytes and {MANIFEST} says {size}: the file is truncated or was replaced"
    got = _digests(root, _share(sorted(want), rank, world), world)
    for name in sorted(got):
        if got[name][1] != want[name][1]:
            return (f"{os.path.join(root, name)} is damaged: its CRC32 is {got[name][1]} and {MANIFEST} "
                    f"says {want[name][1]}")
    return None
