"""Worker jobs for the distributed tests: each runs on every rank of a local gloo group
(`train.parallel.run_workers`). Several checks are grouped into one job per layout, because
every job starts processes and a gloo group."""
from __future__ import annotations

import torch

from checkpoint_tools.verify import megatron_logits
from dapo_megatron.config.schema import ParallelConfig


def environment_probe() -> dict:
    """What a rank sees at the start of its job (test_run_workers)."""
    import gc
    import os
    return dict(marker=os.environ.get("DAPO_TEST_MARKER"), rank=os.environ["RANK"], world=os.environ["WORLD_SIZE"],
                pid=os.getpid(), gc=(gc.isenabled(), gc.get_freeze_count()))


def fail_on_rank(bad_rank: int) -> None:
    import os
    if int(os.environ["RANK"]) == bad_rank:
        raise ValueError(f"rank {bad_rank} says no")


def _build(hf_dir: str, dtype: str = "fp32"):
    from dapo_megatron.models import ModelSpec, build_model
    from dapo_megatron.weights import load_hf_checkpoint
    chunks = build_model(ModelSpec.from_pretrained(hf_dir), dtype=dtype, perform_initialization=False)
    load_hf_checkpoint(chunks, hf_dir)
    return chunks


def _compare_export(chunks, hf_dir: str, experts: str = "gather") -> tuple[set, list]:
    """Export and compare with the HF files: (names yielded, names not bit-identical)."""
    from dapo_megatron.weights import HFCheckpoint, export_hf
    ckpt = HFCheckpoint(hf_dir)
    names, bad = set(), []
    for bucket in export_hf(chunks, bucket_bytes=1 << 16, experts=experts):
        for name, tensor in bucket:
            if name in names:
                bad.append(f"{name} yielded twice")
            names.add(name)
            ref = ckpt.read(name)
            if ref.dtype != tensor.dtype or ref.shape != tensor.shape or not torch.equal(ref, tensor):
                bad.append(name)
    return names, bad


def roundtrip_and_logits(hf_dirs: list[str], parallel: dict, tokens: torch.Tensor, bad_dir: str | None = None):
    """Per HF dir: load -> export bit-exactness (both expert modes under EP) and the
    full-vocab logits for the parity check done in the parent against HF transformers.
    With `bad_dir`: the error every rank raises loading it into the first model."""
    from dapo_megatron.train.parallel import init_parallel
    info = init_parallel(ParallelConfig(**parallel))
    results = []
    for hf_dir in hf_dirs:
        chunks = _build(hf_dir)
        names, bad = _compare_export(chunks, hf_dir)
        out = {"names": names, "bad": bad, "pp_rank": info.pp_rank}
        if parallel.get("ep", 1) > 1:
            out["owner_names"], out["owner_bad"] = _compare_export(chunks, hf_dir, experts="owner")
        logits = megatron_logits(chunks, tokens)  # through the pipeline schedule, any PP
        out["logits"] = None if logits is None else logits.clone()
        results.append(out)
        if bad_dir is not None and len(results) == 1:
            out["bad_dir_error"] = _load_error(chunks, bad_dir)
    return results


def _load_error(chunks, hf_dir: str) -> str:
    from dapo_megatron.weights import CheckpointError, load_hf_checkpoint
    try:
        load_hf_checkpoint(chunks, hf_dir)
    except CheckpointError as e:
        return str(e)
    return "no error"


def broadcast_sync_job(ports: list[int]) -> bytes:
    """Ranks 0 and 1 are trainer ranks that each send two buckets through their own
    BroadcastTransport (weights/transport.py); rank 2 is an engine whose one transport receives
    both senders at once, on two threads."""
    import os
    import threading

    from actor_jobs import pack
    from dapo_megatron.device import get_device
    from dapo_megatron.weights.transport import BroadcastTransport
    rank, device = int(os.environ["RANK"]), get_device("cpu")
    transport = BroadcastTransport(device)
    if rank < 2:
        g = torch.Generator().manual_seed(rank)
        buckets = [[(f"s{rank}.a", torch.randn(3, 5, generator=g)), (f"s{rank}.b", torch.randn(7, generator=g).bfloat16()),
                    (f"s{rank}.c", torch.randn(3, generator=g))],  # c follows 14 bytes of b: needs the alignment
                   [(f"s{rank}.d", torch.arange(5) * (rank + 1)), (f"s{rank}.e", torch.tensor([True, False, True]))]]
        # The engine handles only count here (one receiver); this transport never calls them.
        sender = transport.sender(engines=["engine"], address=("127.0.0.1", ports[rank]))
        for bucket in buckets:
            sender.send(bucket)
        sender.flush()
        sender.close()
        return pack({name: t for bucket in buckets for name, t in bucket})
    got, lock, counts = {}, threading.Lock(), []

    def load(bucket):
        with lock:
            got.update((name, t.clone()) for name, t in bucket)
        return len(bucket)

    def run(port):
        counts.append(transport.receive(("127.0.0.1", port), 1, 2, load))
    threads = [threading.Thread(target=run, args=(p,)) for p in ports]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return pack(dict(got=got, counts=sorted(counts), groups=len(transport._groups)))
