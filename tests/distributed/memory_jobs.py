"""The activation-memory measurement behind tests/distributed/test_plan_memory.py."""
from __future__ import annotations

import ctypes
import threading

import torch

import actor_jobs
from dapo_megatron.batch import RolloutBatch
from dapo_megatron.config.schema import ParallelConfig


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakRss:
    """The peak resident set of this process while the block runs, sampled every 2 ms, minus
    its size when the block started (the idle baseline: weights, grads, optimizer state)."""

    def __enter__(self):
        self.base, self.peak, self._stop = _rss(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            self._stop.wait(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss()) - self.base


def batch_of(rows: int, length: int, vocab: int, seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    prompt = length // 4
    batch = RolloutBatch(prompts=[torch.randint(0, vocab, (prompt,), generator=g) for _ in range(rows)],
                         responses=[torch.randint(0, vocab, (length - prompt,), generator=g) for _ in range(rows)],
                         group=torch.arange(rows) // 2, prompt_index=torch.arange(rows) // 2)
    batch.advantages = torch.randn(rows, generator=g)
    return batch


def activation_peaks(hf_dir: str, lengths: list[int], rows: int) -> list[int]:
    """Peak bytes above the idle baseline of one update of `rows` sequences of each length (one
    micro-batch, fp32, TP1) after a warm-up update that allocated the optimizer state. glibc is
    told to mmap every block over 64 KiB, so a freed tensor leaves the resident set at once."""
    from dapo_megatron.train.actor import Actor
    from dapo_megatron.train.parallel import init_parallel
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD
    init_parallel(ParallelConfig())
    vocab = 32000
    actor = Actor(actor_jobs.actor_config({}, ppo_mini_batch_size=rows // 2, max_tokens_per_microbatch=rows * max(lengths)),
                  hf_dir, n=2)
    out = []
    for i, length in enumerate([64] + list(lengths)):  # the first, short: allocates Adam's state
        batch = batch_of(rows, length, vocab, seed=i)
        with torch.no_grad():
            batch.old_logprobs = actor_jobs.everywhere(actor.compute_logprobs(batch))["logprobs"]
        batch.ref_logprobs = batch.old_logprobs - 0.05
        with PeakRss() as peak:
            actor.update(batch)
        out.append(peak.peak)
    return out[1:]
