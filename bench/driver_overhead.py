"""Driver overhead per step as the batch and the responses grow: driver CPU, bytes through the
driver, and bytes each training rank reads from the data plane.

    python bench/driver_overhead.py [--batch-sizes 4,8,16] [--response-lengths 24,96] [--steps 3]
                                    [--router-replay off,actor]

Runs the quickstart loop (2 EP ranks, one vLLM-CPU engine, tiny warm-started MoE) for a few
steps per train_batch_size (gen_batch_size = train_batch_size, dynamic sampling off so every
step trains on the same number of groups) and reports, from metrics.jsonl, medians over the steps
after the first: wall time per step, the driver process's CPU seconds per step (`driver/cpu_s`:
advantages, metadata, logging, as opposed to waiting on the rollout manager and the ranks), the
bytes the control plane (the rollout manager, which collects) received per response
(`driver/bytes_per_response`: engines' and reward worker's replies, metadata only),
and the bytes a training rank read from the data plane over the step (`data_plane/bytes_get`,
mean and largest rank: equal when the DP split is balanced).
`--response-lengths` sets data.max_response_length; responses run to it (rollout.ignore_eos: the
tiny model would otherwise stop after ~5 tokens) unless `--stop-at-eos`. The table shows the mean
length reached.
`--router-replay off,actor` adds a row per actor.router_replay mode: what routing replay costs in
step time and in bytes per response (the routes: [P + R, layers, top_k] int16 per response).
"""
from __future__ import annotations

import argparse
import tempfile

from common import median, read_metrics
from results import Table, write


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="4,8,16")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--router-replay", default="off", help="actor.router_replay modes, comma-separated")
    p.add_argument("--response-lengths", default="16,256", help="data.max_response_length values, comma-separated")
    p.add_argument("--stop-at-eos", action="store_true", help="let responses end at EOS (no rollout.ignore_eos)")
    args = p.parse_args()

    import ray

    from dapo_megatron.config import load_config
    from dapo_megatron.driver.supervisor import run
    rows = []
    cases = [(int(b), mode, int(length)) for b in args.batch_sizes.split(",") for mode in args.router_replay.split(",")
             for length in args.response_lengths.split(",")]
    for bs, mode, length in cases:
        with tempfile.TemporaryDirectory() as out:
            cfg = load_config("quickstart", [
                f"data.train_batch_size={bs}", f"data.gen_batch_size={bs}", f"actor.ppo_mini_batch_size={bs}",
                f"rollout.n={args.n}", "algorithm.filter_groups.enable=false",
                f"trainer.total_training_steps={args.steps}", "trainer.save_freq=0", "trainer.test_freq=0",
                "trainer.val_before_train=false", "trainer.logger=[jsonl]", f"trainer.default_local_dir={out}",
                "trainer.resume_mode=disable", f"actor.router_replay={mode}", f"data.max_response_length={length}",
                f"rollout.ignore_eos={not args.stop_at_eos}"])
            try:
                run(cfg)
            finally:
                ray.shutdown()
            steps = read_metrics(out)
        med = {k: median(steps, k, skip=1) for k in  # the first step warms up; no old_logprob: on-policy
               ("timing/step", "timing/gen", "timing/old_logprob", "timing/update", "timing/sync", "driver/cpu_s",
                "driver/bytes_per_response", "sampling/generated_tokens", "response_length/mean",
                "data_plane/bytes_get", "data_plane/bytes_get_max")}
        rows.append((str(bs), mode, str(length), f"{med['response_length/mean']:.1f}", str(bs * args.n),
                     f"{med['sampling/generated_tokens']:.0f}", f"{med['timing/step']:.2f}",
                     *(f"{med[f'timing/{k}']:.3f}" for k in ("gen", "old_logprob", "update", "sync")),
                     f"{med['driver/cpu_s']:.3f}", f"{med['driver/cpu_s'] / med['timing/step']:.1%}",
                     f"{med['driver/bytes_per_response']:.0f}",
                     f"{med['data_plane/bytes_get'] / 1e3:.1f}", f"{med['data_plane/bytes_get_max'] / 1e3:.1f}"))
    head = ("groups", "router replay", "max response", "mean response", "responses", "tokens", "step s", "gen s",
            "old logprob s", "update s", "sync s", "driver CPU s", "driver share", "driver B/response",
            "rank reads kB (mean)", "rank reads kB (max)")
    print(f"\ndriver overhead per step (median of steps 2..{args.steps})")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    write("driver_overhead", title="Driver overhead as the batch and the responses grow",
          measures="The quickstart loop for a few steps per batch size and response length, medians over the steps "
                   "after the first: the driver's CPU a step, the bytes through the driver per response, and the bytes "
                   "each training rank reads from the data plane.",
          tables=[Table("sizes", f"Bytes through the driver and read by each training rank, by batch and response length "
                        f"({args.n} responses a prompt, median of steps 2..{args.steps})",
                        ["prompts a step", "responses a step", "response length (tokens)", "driver: bytes per response",
                         "each rank reads (kB a step)"],
                        [[int(r[0]), int(r[4]), int(r[2]), int(r[13]), float(r[14])] for r in rows])],
          extra={"columns": list(head), "rows": rows})


if __name__ == "__main__":  # Ray and vLLM may spawn processes: the guard keeps them from re-running this
    main()
