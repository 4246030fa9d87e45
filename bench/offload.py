"""actor.offload on one device: the memory an offload frees, its time, and that it changes nothing.

    python bench/offload.py                                   # CPU: the tiny Qwen3-MoE, fp32
    python bench/offload.py --hidden 2048 --layers 12 --experts 16 --moe-ffn 1024 --ffn 5632 \\
        --vocab 32000 --dtype bf16                            # GPU: ~1B parameters, bf16

Two identical Megatron actors (world size 1, distributed optimizer, random init, B a copy of A)
take the same DAPO update (control: are two identical updates bit-identical on this device?);
then B offloads params, grads and optimizer state (train/offload.py), loads them back, and both
take a second update: their weights and optimizer state must stay bit-identical. Prints a table
of device memory allocated before / after the offload and after the onload (the device's own
counter; none on a CPU), the bytes each group moved and the offload / onload seconds.
Deterministic kernels are asked for (torch.use_deterministic_algorithms, warn only) so that
MoE token scatter-adds do not differ between the two actors.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from results import Table, write

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "distributed"))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 0), ("layers", 0), ("experts", 0), ("moe-ffn", 0), ("ffn", 0), ("heads", 0),
                          ("kv-heads", 0), ("vocab", 509), ("samples", 16), ("prompt", 200), ("response", 200)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    return p.parse_args(argv)


def parse_defaults() -> dict:
    return vars(parse([]))


def model_dir(args) -> str:
    """config.json of a Qwen3-MoE (the tiny one with the given sizes); weights are not needed."""
    from dapo_megatron.assets.models import tiny_config
    sizes = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_experts": args.experts,
             "moe_intermediate_size": args.moe_ffn, "intermediate_size": args.ffn,
             "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads}
    cfg = tiny_config("qwen3_moe", args.vocab, **{k: v for k, v in sizes.items() if v})
    if args.heads:
        cfg.head_dim = 128
    out = tempfile.mkdtemp(prefix="offload-bench-")
    cfg.save_pretrained(out)
    return out


def gb(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    args = parse()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29563"))
    import actor_jobs
    from dapo_megatron.config.schema import ParallelConfig
    from dapo_megatron.device import get_device
    from dapo_megatron.train.actor import Actor
    from dapo_megatron.train.offload import GROUPS, optimizer_tensors
    from dapo_megatron.train.parallel import init_parallel
    dev = get_device()
    init_parallel(ParallelConfig(), dev)
    hf_dir = model_dir(args)
    config = actor_jobs.actor_config({}, optim=dict(use_distributed_optimizer=True), use_kl_loss=False,
                                     max_tokens_per_microbatch=8192)
    a = Actor(config, hf_dir, n=2, dtype=args.dtype, load_weights=False)
    b = Actor(config, hf_dir, n=2, dtype=args.dtype, load_weights=False)
    with torch.no_grad():  # B = A, then its fp32 master copies from its (new) parameters
        for pb, pa in zip(b.model[0].parameters(), a.model[0].parameters()):
            pb.copy_(pa)
    b.optimizer.reload_model_params()
    params = sum(p.numel() for p in a.model[0].parameters())

    def step(actor, seed):
        batch = actor_jobs.make_batch(n_samples=args.samples, vocab=args.vocab, seed=seed, max_prompt=args.prompt,
                                      max_response=args.response)
        old = actor_jobs.everywhere(actor.compute_logprobs(batch))["logprobs"]
        batch.old_logprobs = actor_jobs.perturbed_old(old, seed=seed)
        return actor.update(batch)

    def same(x, y) -> tuple[bool, float]:
        xs = [p.detach() for p in x.model[0].parameters()] + optimizer_tensors(x.optimizer)()
        ys = [p.detach() for p in y.model[0].parameters()] + optimizer_tensors(y.optimizer)()
        equal = len(xs) == len(ys) and all(torch.equal(s, t) for s, t in zip(xs, ys))
        return equal, max(float((s.float() - t.float()).abs().max()) for s, t in zip(xs, ys))

    for actor in (a, b):
        step(actor, 1)
    control = same(a, b)
    mem = lambda: dev.memory_gb().get("allocated", float("nan")) * 2**30  # noqa: E731
    dev.synchronize()
    before = mem()
    nbytes = {g: sum(s.nbytes() for s in b.offloader._storages(g)) for g in GROUPS}
    t0 = time.perf_counter()
    b.offload(list(GROUPS))
    dev.synchronize()
    t_off, during = time.perf_counter() - t0, mem()
    t0 = time.perf_counter()
    b.onload(list(GROUPS))
    dev.synchronize()
    t_on, after = time.perf_counter() - t0, mem()
    for actor in (a, b):
        step(actor, 2)
    result = same(a, b)
    print(f"device: {dev.kind} {torch.cuda.get_device_name() if dev.kind == 'cuda' else ''}; "
          f"{params / 1e9:.3f}B parameters ({args.dtype}); two actors resident")
    print("| | GiB |\n|---|---|")
    for g in GROUPS:  # the grads are freed, not copied: dead between updates (train/offload.py)
        print(f"| {g} {'freed' if g == 'grads' else 'copied to host'} (one actor) | {gb(nbytes[g])} |")
    print(f"| allocated before offload | {gb(before)} |\n| allocated while offloaded | {gb(during)} |\n"
          f"| allocated after onload | {gb(after)} |")
    moved = sum(nbytes.values())
    print(f"offload {t_off:.3f} s ({moved / t_off / 2**30:.1f} GiB/s), onload {t_on:.3f} s "
          f"({moved / t_on / 2**30:.1f} GiB/s)")
    print(f"control (two identical updates): bit-identical {control[0]} (max diff {control[1]:.3g}); "
          f"after offload + onload + update: bit-identical {result[0]} (max diff {result[1]:.3g})")
    device = f"{dev.kind}{' ' + torch.cuda.get_device_name() if dev.kind == 'cuda' else ''}"
    memory = (f"{gb(before)} / {gb(during)} / {gb(after)} GiB" if before == before  # nan: no device counter
              else f"no device counter on a {dev.kind}")
    ident = lambda same: "bit-identical" if same[0] else f"DIFFERENT (max diff {same[1]:.3g})"  # noqa: E731
    sizes = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v != parse_defaults().get(k))
    write("offload", title="actor.offload on one device",
          measures="Two identical Megatron actors take the same update; then one offloads params, grads and optimizer "
                   "state, loads them back, and both take a second update: they must stay bit-identical.",
          tables=[Table("offload", "What was checked", ["device, model", "control: two identical updates",
                                                         "offload -> onload -> update",
                                                         "device memory before / while / after"],
                        [[f"{device}, {params / 1e9:.3f}B parameters, {args.dtype}" + (f" (`{sizes}`)" if sizes else ""),
                          ident(control), ident(result) + " to the update without offload (weights and Adam state)",
                          memory]])],
          extra={"offload_s": t_off, "onload_s": t_on, "bytes": nbytes})


if __name__ == "__main__":
    main()
