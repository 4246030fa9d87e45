"""The built-in Python code interpreter: model-written code in a process of its own, bounded.

Each call gets a fresh temporary directory (its cwd and HOME), an empty environment (no
inherited variables or credentials), and these bounds, all reported as a tool message and never
raised: wall-clock time (the whole process group is killed), CPU seconds, address space,
address space, output size; no new processes (a seccomp filter: a fork bomb's first fork fails;
threads still start). Where the kernel has Landlock (Linux >= 5.13), the process may write only
inside its directory and read only the interpreter's and the system's files (not the parent's
/proc/<pid>/environ), and, with Landlock ABI >= 4, open no TCP connection.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# Landlock (include/uapi/linux/landlock.h): syscall numbers (x86-64 / arm64 share them) and rights.
_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446
_PR_SET_NO_NEW_PRIVS = 38
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_WRITES = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # write, remove, make anything
_REFER, _TRUNCATE = 1 << 13, 1 << 14
_NET_CONNECT_TCP, _NET_BIND_TCP = 1 << 1, 1 << 0
_SCOPE_SIGNAL = 1 << 1  # ABI 6: no signals to processes outside the sandbox


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    processes: int = 16  # the interpreter's own threads count too
    output_chars: int = 4000


@dataclass(frozen=True)
class Result:
    output: str  # stdout + stderr, truncated to Limits.output_chars
    ok: bool  # exit code 0 within the limits
    error: str = ""  # "timeout" | "exit <code>" | "killed by <signal>" | ""

    def message(self) -> str:
        """What goes back to the model as the tool's message."""
        return self.output if self.ok else f"{self.output}\n[error: {self.error}]".lstrip("\n")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when it has none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return max(int(libc.syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))), 0)
    except (OSError, AttributeError):
        return 0


def _landlock(writable: str, readable: list[str], abi: int) -> None:
    """Restrict this process (before exec): write only under `writable`, read and execute only
    under `readable` + `writable`; no TCP (ABI >= 4); no signals out (ABI >= 6)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fs = _EXECUTE | _READ_FILE | _READ_DIR | _WRITES | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
    net = (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0
    scoped = _SCOPE_SIGNAL if abi >= 6 else 0
    fields = [fs] + ([net] if abi >= 4 else []) + ([scoped] if abi >= 6 else [])
    attr = (ctypes.c_uint64 * len(fields))(*fields)
    ruleset = libc.syscall(_SYS_CREATE, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    for path, rights in [(writable, fs)] + [(p, _EXECUTE | _READ_FILE | _READ_DIR) for p in readable]:
        if not os.path.exists(path):
            continue
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        allowed = rights if os.path.isdir(path) else rights & (_EXECUTE | _READ_FILE | _WRITE_FILE | _TRUNCATE)
        rule = PathBeneath(allowed, fd)
        libc.syscall(_SYS_ADD_RULE, ruleset, 1, ctypes.byref(rule), ctypes.c_uint32(0))
        os.close(fd)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.syscall(_SYS_RESTRICT, ruleset, ctypes.c_uint32(0)) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")


def _readable_paths() -> list[str]:
    """What the interpreter needs to start and import: its prefix, its import path, the system
    libraries, /dev (null, urandom) and its own /proc entry."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             "/usr", "/lib", "/lib64", "/bin", "/etc", "/dev", "/proc/self"}
    paths.update(p for p in sys.path if p and os.path.isdir(p))
    return sorted(paths)


# seccomp: per machine, (audit arch, syscalls that only make processes, clone). A clone without
# CLONE_THREAD is a new process; clone3 passes its flags in memory BPF cannot read, so it gets
# ENOSYS and the C library falls back to clone (threads still start, processes do not).
_SECCOMP_ARCH = {"x86_64": (0xC000003E, (57, 58), 56), "aarch64": (0xC00000B7, (), 220)}
_CLONE3, _CLONE_THREAD = 435, 0x10000
_RET_ALLOW, _RET_KILL, _RET_EPERM, _RET_ENOSYS = 0x7FFF0000, 0x80000000, 0x00050001, 0x00050026


def _no_new_processes() -> bool:
    """A seccomp filter: fork / vfork / clone of a process fail with EPERM; threads are fine.
    False on a machine whose syscall numbers the table lacks."""
    import platform
    if platform.machine() not in _SECCOMP_ARCH:
        return False
    arch, forks, clone = _SECCOMP_ARCH[platform.machine()]
    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06
    # (code, jump if true, jump if false, k); jumps are relative to the next instruction
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, _RET_KILL), (ld, 0, 0, 0)]
    body = [(jeq, None, 0, nr) for nr in forks] + [(jeq, None, 0, _CLONE3), (jeq, 0, 2, clone),
                                                   (ld, 0, 0, 16), (jset, 0, 1, _CLONE_THREAD)]
    tail = [(ret, 0, 0, _RET_ALLOW), (ret, 0, 0, _RET_EPERM), (ret, 0, 0, _RET_ENOSYS)]
    start, allow = len(prog), len(prog) + len(body)
    for i, (code, jt, jf, k) in enumerate(body):
        here = start + i + 1
        if jt is None:  # fork / vfork -> EPERM, clone3 -> ENOSYS
            jt = (allow + (2 if k == _CLONE3 else 1)) - here
        prog.append((code, jt, jf, k))
    prog += tail

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(prog))(*[Filter(*f) for f in prog])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(22, 2, ctypes.byref(Program(len(prog), filters)), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
        raise OSError(ctypes.get_errno(), "seccomp")
    return True


def confine(workdir: str, limits: Limits, abi: int, readable: list[str]) -> None:
    """Bound this process, forbid new processes, then Landlock it. The sandbox process's first
    act, before the model's code runs (not a preexec_fn: the parent may run threads)."""
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    mem = limits.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
    # root is exempt from RLIMIT_NPROC, so the fork-bomb bound is the seccomp filter; the limit
    # still holds threads and processes of a non-root user where that filter cannot load
    if not _no_new_processes() and os.geteuid() != 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    if abi:
        _landlock(workdir, readable, abi)


_BOOT = """import json, runpy, sys
from dapo_megatron.toolcall.sandbox import Limits, confine
a = json.loads(sys.argv[1])
confine(a["workdir"], Limits(**a["limits"]), a["abi"], a["readable"])
del json, a, confine, Limits
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_python(code: str, limits: Limits = Limits()) -> Result:
    """Run `code` with the interpreter that runs us, isolated (-I), in a fresh directory."""
    workdir = tempfile.mkdtemp(prefix="dapo-tool-")
    with open(os.path.join(workdir, "main.py"), "w") as f:
        f.write(code)
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    args = json.dumps(dict(workdir=workdir, limits=vars(limits), abi=landlock_abi(), readable=_readable_paths()))
    start = time.monotonic()
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, args], cwd=workdir, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                close_fds=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=limits.wall_s)
            error = "" if proc.returncode == 0 else (f"exit {proc.returncode}" if proc.returncode > 0
                                                     else f"killed by {signal.Signals(-proc.returncode).name}")
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, _ = proc.communicate()
            error = f"timeout after {time.monotonic() - start:.1f} s"
        finally:
            _kill_group(proc)  # descendants that outlived the interpreter
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = out.decode("utf-8", "replace")
    if len(text) > limits.output_chars:
        text = text[: limits.output_chars] + f"\n[output truncated at {limits.output_chars} characters]"
    return Result(text, not error, error)
