"""Weight sync, actor -> vLLM engine: time and bytes per sync by model size and actor layout.

    python bench/weight_sync.py [--sizes 10,50,200] [--layouts tp2,ep2,tp2xep2] [--repeats 3]
                                [--transports object_store,broadcast]

For each size (Qwen3-MoE, 8 experts, fp32, random init) and actor layout, the driver's own path
(`driver.weight_sync.sync_weights`: pause -> each rank sends what it owns through `rollout.sync.transport` ->
post-process -> reset prefix cache -> resume) into one in-process vLLM engine, next to, in the
same run: (a) a raw transfer of the same bytes over the same transport (a worker `ray.put`s
buckets of the same size, another actor receives them) and (b) a memcpy of the same bytes.
Bytes moved = bytes the engine received; the minimum is the HF model size (each engine rank
receives each of its bytes once). `--transports` (rollout.sync.transport) adds rows for the
broadcast transport, whose raw transfer is a broadcast of the same buckets over its own kind of
group (gloo on CPU) between two Ray actors.
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time

from common import median
from results import Table, write

# hidden 512, 8 heads (head_dim 64), 4 kv heads, 8 experts of 512, vocab 4096: ~7.1M params per
# layer, ~4.2M in the embeddings; the layer count sets the size.
MODEL = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             moe_intermediate_size=512, intermediate_size=1024, num_experts=8, num_experts_per_tok=2)
LAYERS = {10: 1, 50: 6, 200: 28}
LAYOUTS = {"tp2": dict(tp=2, etp=2), "ep2": dict(ep=2), "tp2xep2": dict(tp=2, ep=2), "tp1": dict()}


def _median_time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return median(times), out


def _raw_transfer(nbytes: int, bucket_bytes: int, repeats: int) -> float:
    """Seconds to move `nbytes` in buckets from one Ray actor into another's memory."""
    import ray
    import torch

    @ray.remote(num_cpus=0)
    class Sink:
        def recv(self, bucket) -> int:
            return sum(t.numel() for _, t in bucket)

    @ray.remote(num_cpus=0)
    class Source:
        def send(self, sink, nbytes: int, bucket_bytes: int) -> float:
            tensors = [torch.ones(min(bucket_bytes, nbytes - s) // 4) for s in range(0, nbytes, bucket_bytes)]
            t0 = time.perf_counter()
            pending = []
            for i, t in enumerate(tensors):  # one bucket in flight, as the sync transport does
                ref = ray.put([(f"t{i}", t)])
                ray.get(pending)
                pending = [sink.recv.remote(ref)]
            ray.get(pending)
            return time.perf_counter() - t0

    sink, source = Sink.remote(), Source.remote()
    sec = median(ray.get(source.send.remote(sink, nbytes, bucket_bytes)) for _ in range(repeats))
    ray.kill(sink)
    ray.kill(source)
    return sec


def _raw_broadcast(nbytes: int, bucket_bytes: int, repeats: int, device: str) -> float:
    """Seconds to broadcast `nbytes` in flat buckets from one Ray actor to another over the
    broadcast transport's own group (weights/transport.py), without headers or loading."""
    import ray
    import torch
    from dapo_megatron.device import get_device
    from dapo_megatron.parallel import free_port
    from dapo_megatron.weights import transport

    @ray.remote(num_cpus=0)
    class Peer:
        def run(self, address, rank: int, sizes: list[int], repeats: int) -> list[float]:
            dev = get_device(device)
            group = transport.connect(dev, *address, rank=rank, size=2)
            buffers = [torch.ones(n, dtype=torch.uint8, device=dev.current_device()) for n in sizes]
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for b in buffers:
                    group.broadcast(b, 0).wait()
                times.append(time.perf_counter() - t0)
            return times

    sizes = [min(bucket_bytes, nbytes - s) for s in range(0, nbytes, bucket_bytes)]
    address = (ray.util.get_node_ip_address(), free_port(""))
    peers = [Peer.remote(), Peer.remote()]
    times = ray.get([p.run.remote(address, r, sizes, repeats) for r, p in enumerate(peers)])[1]
    for peer in peers:
        ray.kill(peer)
    return median(times)


def _memcpy(nbytes: int, repeats: int) -> float:
    import torch
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return _median_time(lambda: dst.copy_(src), repeats)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10,50,200", help=f"model sizes in M params, of {sorted(LAYERS)}")
    p.add_argument("--layouts", default="tp2,ep2,tp2xep2", help=f"actor layouts, of {sorted(LAYOUTS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--transports", default="object_store", help="rollout.sync.transport values to run")
    args = p.parse_args()

    import ray

    from dapo_megatron.assets.models import build_tiny_model
    from dapo_megatron.driver.weight_sync import sync_weights
    from dapo_megatron.tools.check_sync.run import release, start, sync_config
    from dapo_megatron.weights import HFCheckpoint
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            path = build_tiny_model("qwen3_moe", f"{tmp}/m{size}", vocab_size=4096, num_hidden_layers=LAYERS[size],
                                    **MODEL)
            ckpt = HFCheckpoint(path)
            model_bytes = sum(math.prod(ckpt.shape(k)) * 4 for k in ckpt.keys())  # fp32
            params_m = model_bytes / 4 / 1e6
            for name, transport in ((n, t) for n in args.layouts.split(",") for t in args.transports.split(",")):
                cfg = sync_config(path, LAYOUTS[name], device=args.device, transport=transport)
                bucket_bytes = cfg.rollout.sync.bucket_mb << 20
                placement = start(cfg)
                try:
                    sync = lambda: sync_weights(placement.train, placement.engines, cfg.rollout.sync,
                                                verify=False)
                    first, _ = _median_time(sync, 1)  # records the sync plan; vLLM's reload set-up
                    sec, out = _median_time(sync, args.repeats)
                finally:
                    release(placement)
                if transport == "broadcast":
                    raw = _raw_broadcast(out["sync/bytes"], bucket_bytes, args.repeats, args.device)
                else:
                    raw = _raw_transfer(out["sync/bytes"], bucket_bytes, args.repeats)
                copy = _memcpy(out["sync/bytes"], args.repeats)
                gb = out["sync/bytes"] / 1e9
                rows.append((f"{params_m:.0f}M", name, transport, f"{gb * 1e3:.0f}", f"{out['sync/bytes'] / model_bytes:.2f}",
                             f"{first:.2f}", f"{sec:.2f}", f"{gb / sec:.2f}", f"{raw:.2f}", f"{sec / raw:.2f}",
                             f"{copy:.3f}"))
                print(" | ".join(rows[-1]), flush=True)
    ray.shutdown()
    head = ("params", "actor", "transport", "MB moved", "moved/min", "1st sync s", "sync s", "GB/s", "raw s", "sync/raw",
            "memcpy s")
    print("\nweight sync into one vLLM engine (median of", args.repeats, "syncs)")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    transports = args.transports.split(",")
    by_case = {}  # (params, layout) -> transport -> sync s
    for r in rows:
        by_case.setdefault((r[0], r[1]), {})[r[2]] = r[6]
    write("weight_sync", title="Weight sync, actor -> vLLM engine",
          measures="The driver's own weight sync (pause -> each rank sends what it owns -> post-process -> resume) "
                   "into one in-process vLLM engine, by model size, actor layout and transport.",
          tables=[Table("sync", f"Seconds a sync into one engine, by model size, actor layout and transport (median of "
                        f"{args.repeats} syncs)", ["params", "actor layout", *(f"{t} (s)" for t in transports)],
                        [[params, layout, *(t_s.get(t, "-") for t in transports)]
                         for (params, layout), t_s in by_case.items()])],
          extra={"columns": list(head), "rows": rows})


if __name__ == "__main__":  # vLLM and Ray may spawn processes: the guard keeps them from re-running this
    main()
