"""The CPU kernels a tiny bundle is built with, and the checksums that show what a build gave.

A bundle's warm-up is a few hundred fp32 training steps, and fp32 CPU kernels take their code
path from the processor: torch's vectorized kernels by `ATEN_CPU_CAPABILITY` (default / avx2 /
avx512), MKL's matrix products by vendor and instruction set, oneDNN's (gelu, ...) by its ISA;
the paths round differently and the steps carry the difference on. A build runs in a process
started with PINNED, which holds each library at a level every x86-64-v2 CPU runs, so the same
recipe gives the same bytes on any of them. Measured on this repository's 2-core AMD EPYC (AVX2,
FMA, no AVX-512): each setting alone changes bytes (torch's capability and MKL's mode the text
models' after 20 warm-up steps, oneDNN's ISA gelu, which the VL tower uses); pinned, a build
told it runs on a smaller CPU gives the same files; a pinned build takes 1.1-1.5x a native one's
time (docs/reproducibility.md, bench/assets_compare.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

MANIFEST = "manifest.json"

# variable -> value. The libraries read these as they load, so they are a process's settings, set
# when the build's process starts (build.py), never inside a training run.
PINNED = {
    "ATEN_CPU_CAPABILITY": "default",  # torch's portable kernels, not its avx2 / avx512 builds
    "MKL_CBWR": "SSE4_2",  # MKL's conditional numerical reproducibility: SSE4.2's results on any newer CPU
    "ONEDNN_MAX_CPU_ISA": "SSE41",  # oneDNN's lowest ISA
    # one thread: a reduction split over threads adds in another order (the warm-ups set it too)
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
}
# A smaller CPU, as far as the libraries can be told: what `compare` builds under beside the
# machine itself. The pins hold against it; an unpinned build follows it.
SMALLER_CPU = {
    "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F,-AVX2,-FMA,-AVX",
}
KERNELS = ("pinned", "native")  # a build's kernels: PINNED, or whatever the machine and environment give


def pinned_env(base: Mapping[str, str]) -> dict[str, str]:
    """`base` with the pins over it (they win over the environment's own kernel settings)."""
    return {**base, **PINNED}


def pinned_here() -> bool:
    """Whether this process was started with the pins (its libraries read them as they loaded)."""
    return all(os.environ.get(key) == value for key, value in PINNED.items())


_RESULT = "pinned-call-result: "  # the child's last line: what the function returned, as JSON
# The child must find its pins: without them a build would start a child of its own, and so on.
_CHILD = ("import importlib, json, sys; from dapo_megatron.assets import kernels; "
          "kernels.pinned_here() or sys.exit('the process started without the pinned kernels'); "
          "module, name = sys.argv[1].split(':'); kwargs = json.loads(sys.argv[2]); "
          "kwargs.update(log=lambda line: print(line, flush=True)) if sys.argv[3] == 'log' else None; "
          "result = getattr(importlib.import_module(module), name)(**kwargs); "
          f"print({_RESULT!r} + json.dumps(result, default=str), flush=True)")


def call_pinned(function: str, kwargs: dict, *, log: Optional[Callable[[str], None]] = None,
                cwd: Optional[str] = None) -> Any:
    """`module:function(**kwargs)` in a process started with the pins (this one cannot take them
    up: its libraries read them as they loaded); returns what it returned, through JSON. With
    `log`, the function gets a `log` of its own whose lines come here; its errors go to stderr."""
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, function, json.dumps(kwargs), "log" if log else ""],
                            stdout=subprocess.PIPE, text=True, env=pinned_env(os.environ), cwd=cwd)
    result = None
    try:
        for line in proc.stdout:
            if line.startswith(_RESULT):
                result = json.loads(line[len(_RESULT):])
            elif log is not None:
                log(line.rstrip("\n"))
    except BaseException:  # Ctrl-C, a failing `log`: the child goes with its caller
        proc.kill()
        raise
    if proc.wait() != 0:
        raise RuntimeError(f"{function} in a process with the pinned kernels failed (exit {proc.returncode}): "
                           "its error is above")
    return result


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def file_digests(root: Path) -> dict[str, str]:
    """sha256 of every file of a bundle but its manifest, by path relative to `root`."""
    return {str(p.relative_to(root)): _sha256(p) for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}


def bundle_sha256(digests: Mapping[str, str]) -> str:
    """One digest for a bundle: over its files' names and digests, in name order."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name} {digests[name]}\n".encode())
    return h.hexdigest()


def checksum(root: Path) -> dict:
    """What a manifest records of its bundle's bytes."""
    digests = file_digests(root)
    return {"sha256": bundle_sha256(digests), "files": digests}


def changed_file(root: Path, recorded: Mapping[str, str]) -> Optional[str]:
    """Why the bundle at `root` is not what its manifest recorded (`recorded`: name -> sha256), or
    None. Files the manifest does not list (a lock, a user's note) are not its business."""
    for name in sorted(recorded):
        path = root / name
        if not path.is_file():
            return f"{path} is missing ({root / MANIFEST} lists it)"
        digest = _sha256(path)
        if digest != recorded[name]:
            return (f"{path} changed since its bundle was built: its sha256 is {digest[:12]}..., {root / MANIFEST} "
                    f"recorded {recorded[name][:12]}...")
    return None
