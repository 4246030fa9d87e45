"""Converter throughput and memory: HF -> Megatron dist checkpoint -> HF on a generated checkpoint.

    python bench/convert.py [--size-gb 1.0] [--save tp=2,ep=2] [--load pp=2] [--workdir DIR]

Generates a random Qwen3-MoE checkpoint of about --size-gb (fp32; wider and deeper than the
test models), then times, in the same run: a plain copy of its safetensors files (the I/O
baseline), the same copy with each file fsynced (durable, as both converter directions write
before renaming their output into place), `python -m dapo_megatron.convert hf-to-mcore` at
--save and `mcore-to-hf` at --load,
each as a new process like a user's command, and checks the round trip is bit-exact. Peak RSS
is sampled per rank (psutil, every 0.1 s) and shown next to the share of the checkpoint that
rank wrote and the RSS of an idle rank (imports only); in parentheses RSS without file-backed
pages (the memory-mapped safetensors count in RSS but are page cache the kernel can drop).
"net GB/s" subtracts the wall time of a command whose ranks only start (interpreter, imports,
forks, process group): the fixed cost of every convert command. "x copy" is GB/s over the plain
copy's; "net x copy+fsync" is net GB/s over the durable copy's. Each row is the fastest of
--repeats runs (with that run's memory): this shared 2-core machine varies by ~20% run to run.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import psutil
from results import Table, write

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GB = 1e9


def _layout(text: str) -> list[str]:
    """'tp=2,ep=2' -> ['--tp', '2', '--ep', '2']"""
    args = []
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        args += [f"--{key.strip()}", value.strip()]
    return args


def _layers_for(size_gb: float) -> int:
    """Layers of the bench architecture (~88 MB fp32 per layer, ~260 MB of embeddings)."""
    return max(2, round((size_gb * GB - 2 * 32000 * 1024 * 4) / (22.1e6 * 4)))


def build_checkpoint(out: str, size_gb: float) -> str:
    from dapo_megatron.assets.models import build_tiny_model
    return build_tiny_model("qwen3_moe", out, vocab_size=32000, hidden_size=1024, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=128, num_hidden_layers=_layers_for(size_gb),
                            num_experts=8, moe_intermediate_size=768, intermediate_size=2048)


def _copy(src: str, dst: str, durable: bool) -> float:
    """Seconds to copy the safetensors files of `src` (in the kernel, as `cp` does); `durable`
    also fsyncs each copy, as both converter directions do before publishing their output.
    The copy is deleted afterwards, so its dirty pages are not written back during the timings
    that follow."""
    t = time.perf_counter()
    os.makedirs(dst)
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
            if durable:
                fd = os.open(os.path.join(dst, f), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
    seconds = time.perf_counter() - t
    shutil.rmtree(dst)
    return seconds


def _dir_bytes(path: str, suffix: str = "") -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(suffix))


class RssSampler:
    """Peak RSS of each rank of a `python -m dapo_megatron.convert` process tree, and of their
    helper processes (dist_checkpointing's writer forks), sampled in a background thread.

    The tree is: CLI process -> forkserver (run_workers) -> ranks -> helpers."""

    def __init__(self, root_pid: int):
        self.root = psutil.Process(root_pid)
        self.peak: dict[int, int] = {}
        self.anon_peak: dict[int, int] = {}  # RSS minus file-backed pages (the mmap'd safetensors)
        self.helper_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _ranks(self) -> list:
        servers = [c for c in self.root.children() if "forkserver" in " ".join(c.cmdline())]
        return [r for s in servers for r in s.children() if "resource_tracker" not in " ".join(r.cmdline())]

    def _run(self):
        while not self._stop.is_set():
            try:
                for rank in self._ranks():
                    mem = rank.memory_info()
                    self.peak[rank.pid] = max(self.peak.get(rank.pid, 0), mem.rss)
                    self.anon_peak[rank.pid] = max(self.anon_peak.get(rank.pid, 0), mem.rss - mem.shared)
                    for helper in rank.children(recursive=True):
                        self.helper_peak = max(self.helper_peak, helper.memory_info().rss)
            except psutil.Error:
                pass
            time.sleep(0.1)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _idle_worker(world: int) -> tuple[float, int]:
    """(wall seconds, RSS) of a fresh process that starts `world` workers which only initialise
    the parallel state: the fixed start-up cost inside every convert command (interpreter,
    imports in run_workers' forkserver, forks, process group)."""
    t = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--idle-world", str(world)], check=True,
                         capture_output=True, text=True).stdout
    return time.perf_counter() - t, int(out.split()[-1])


def _idle_job() -> int:
    from dapo_megatron.config.schema import ParallelConfig
    from dapo_megatron.train.parallel import init_parallel
    init_parallel(ParallelConfig())
    return psutil.Process().memory_info().rss


def _timed_convert(argv: list[str]) -> tuple[float, list[str], int]:
    """Run the convert CLI as a user would (a new process), sampling its ranks' memory."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "dapo_megatron.convert", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    with RssSampler(proc.pid) as rss:
        out, err = proc.communicate()
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"convert {' '.join(argv)} failed with exit code {proc.returncode}:\n{err[-2000:]}")
    per_rank = [f"{rss.peak[p] / GB:.2f}({rss.anon_peak[p] / GB:.2f})" for p in sorted(rss.peak, key=rss.peak.get, reverse=True)]
    return seconds, per_rank, rss.helper_peak


def _bit_exact(a_dir: str, b_dir: str) -> bool:
    import torch

    from dapo_megatron.weights import HFCheckpoint
    a, b = HFCheckpoint(a_dir), HFCheckpoint(b_dir)
    return a.keys() == b.keys() and all(torch.equal(a.read(k), b.read(k)) for k in sorted(a.keys()))


def _world(layout: str) -> int:
    from dapo_megatron.convert.run import world_for_layout
    degrees = dict(tp=1, pp=1, ep=1, etp=1)
    degrees.update({k: int(v) for k, v in (item.split("=") for item in filter(None, layout.split(",")))})
    return world_for_layout(degrees)


def run(args) -> list[tuple]:
    work = args.workdir or tempfile.mkdtemp(prefix="bench_convert_")
    hf, ckpt, back = (os.path.join(work, n) for n in ("hf", "mcore", "hf_back"))
    build_checkpoint(hf, args.size_gb)
    os.sync()  # else the generated files' writeback runs during (and slows) the first timings
    size = _dir_bytes(hf, ".safetensors")
    copy_s = min(_copy(hf, os.path.join(work, "copy"), durable=False) for _ in range(args.repeats))
    durable_s = min(_copy(hf, os.path.join(work, "copy_fsync"), durable=True) for _ in range(args.repeats))
    best = lambda fn: min((fn() for _ in range(args.repeats)), key=lambda r: r[0])  # noqa: E731  (by seconds)
    startup_s, idle = best(lambda: _idle_worker(_world(args.save)))
    save_s, save_rss, save_helper = best(lambda: _timed_convert(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt, "--force",
                                                                 *_layout(args.save)]))
    ranks = sorted({f.split("_")[2] for f in os.listdir(ckpt) if f.endswith(".distcp")})
    shards = [sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)
                  if f.endswith(".distcp") and f.split("_")[2] == r) for r in ranks]
    load_s, load_rss, load_helper = best(lambda: _timed_convert(["mcore-to-hf", "--ckpt", ckpt, "--out", back, "--force",
                                                                 *_layout(args.load)]))
    exact = _bit_exact(hf, back)
    gb = lambda xs: "/".join(f"{x / GB:.2f}" for x in xs)  # noqa: E731
    net = lambda s: size / GB / max(s - startup_s, 1e-3)  # noqa: E731  (GB/s without start-up)
    copy_gbps, durable_gbps = size / GB / copy_s, size / GB / durable_s
    rows = [("plain copy", "-", copy_s, copy_gbps, copy_gbps, "-", "-", "-"),
            ("copy+fsync", "-", durable_s, durable_gbps, durable_gbps, "-", "-", "-"),
            ("hf-to-mcore", args.save, save_s, size / GB / save_s, net(save_s), "/".join(save_rss), gb([save_helper]),
             gb(sorted(shards, reverse=True))),
            ("mcore-to-hf", args.load, load_s, size / GB / load_s, net(load_s), "/".join(load_rss), gb([load_helper]), "-")]
    rows = [(*r[:5], r[3] / copy_gbps, r[4] / durable_gbps, *r[5:]) for r in rows]
    print(f"checkpoint {size / GB:.2f} GB ({_layers_for(args.size_gb)} layers, 8 experts), "
          f"idle worker: RSS {idle / GB:.2f} GB, start-up {startup_s:.1f} s; round trip bit-exact: {exact}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--save", default="tp=2,ep=2", help="layout of hf-to-mcore, e.g. tp=2,ep=2")
    p.add_argument("--load", default="pp=2", help="layout of mcore-to-hf, e.g. pp=2")
    p.add_argument("--repeats", type=int, default=2, help="time each row this many times, keep the fastest")
    p.add_argument("--workdir", default=None, help="keep the files here (default: a temp dir, removed)")
    p.add_argument("--idle-world", type=int, default=0, help=argparse.SUPPRESS)  # internal: _idle_worker
    args = p.parse_args(argv)
    if args.idle_world:  # the same order as the convert CLI: start the forkserver, then import
        from dapo_megatron.train import forkserver
        forkserver.start()
        from dapo_megatron.train.parallel import run_workers
        print(max(run_workers(_idle_job, args.idle_world, timeout_s=300)))
        from dapo_megatron.convert import _exit_now
        _exit_now(0)  # as the convert CLI exits
    rows = run(args)
    print(f"{'step':<12} {'layout':<10} {'seconds':>8} {'GB/s':>6} {'net GB/s':>8} {'x copy':>6} {'net x copy+fsync':>16}  "
          f"{'peak RSS(anon)/rank GB':<24} {'helper proc GB':<15} shard/rank GB")
    for step, layout, s, gbps, net, x_copy, x_durable, rss, helper, shard in rows:
        print(f"{step:<12} {layout:<10} {s:>8.2f} {gbps:>6.3f} {net:>8.3f} {x_copy:>6.2f} {x_durable:>16.2f}  "
              f"{rss:<24} {helper:<15} {shard}")
    write("convert", title="Checkpoint conversion",
          measures="hf-to-mcore and mcore-to-hf on a generated checkpoint, timed against a plain and an fsynced copy of "
                   "the same bytes, with each rank's peak RSS.",
          tables=[Table("throughput", f"Conversion time and throughput (the fastest of {args.repeats})",
                        ["checkpoint", "direction", "wall s", "net GB/s vs an fsynced copy", "GB/s vs a plain copy, overall"],
                        [[f"{args.size_gb:g} GB", f"{step} ({layout})", f"{s:.1f}", f"{x_durable:.2f}x", f"{x_copy:.2f}x"]
                         for step, layout, s, _, _, x_copy, x_durable, *_ in rows if layout != "-"])],
          extra={"rows": [list(r) for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
