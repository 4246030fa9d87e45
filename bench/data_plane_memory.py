"""Data-plane memory over a long run: what TransferQueue holds and what its processes use.

    python bench/data_plane_memory.py [--steps 200] [--every 20]

Runs the quickstart for `--steps` steps (no validation, no checkpoints) while a thread samples the
resident memory (RSS) of the TransferQueue controller and storage-unit processes. Prints, every
`--every` steps: `data_plane/resident_mb` (bytes still stored after the step's clear: 0 when
every step's rows were cleared), the storage units' and controller's RSS, and the step time.
Flat RSS after the first steps means nothing accumulates.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time


def _rss_mb(title: str) -> float:
    """Summed RSS of processes whose title names this Ray actor class (Ray titles them ray::Class)."""
    import psutil
    total = 0
    for proc in psutil.process_iter(["cmdline", "memory_info"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if f"ray::{title}" in cmd and proc.info["memory_info"] is not None:
            total += proc.info["memory_info"].rss
    return total / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20)
    args = p.parse_args()

    import ray

    from dapo_megatron.config import load_config
    from dapo_megatron.driver.loop import run
    samples: dict[int, tuple[float, float]] = {}  # step -> (storage RSS MB, controller RSS MB), last seen
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config("quickstart", [f"trainer.total_training_steps={args.steps}", "trainer.save_freq=0",
                                         "trainer.test_freq=0", "trainer.val_before_train=false",
                                         "trainer.logger=[jsonl]", f"trainer.default_local_dir={out}",
                                         "trainer.resume_mode=disable"])
        done = threading.Event()

        def sample():
            path = os.path.join(out, "metrics.jsonl")
            while not done.is_set():
                step = sum(1 for _ in open(path)) if os.path.exists(path) else 0
                samples[step] = (_rss_mb("SimpleStorageUnit"), _rss_mb("TransferQueueController"))
                time.sleep(1.0)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            run(cfg)
        finally:
            done.set()
            ray.shutdown()
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    print(f"\ndata plane memory over {args.steps} quickstart steps")
    head = ("step", "data_plane/resident_mb", "storage units RSS MB", "controller RSS MB", "step s")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        if r["step"] == 1 or r["step"] % args.every == 0:
            storage, controller = samples.get(r["step"], (float("nan"), float("nan")))
            print(f"| {r['step']} | {r['data_plane/resident_mb']:.3f} | {storage:.1f} | {controller:.1f} | "
                  f"{r['timing/step']:.2f} |")


if __name__ == "__main__":  # Ray and vLLM may spawn processes: the guard keeps them from re-running this
    main()
