"""A training rank's host memory step by step on verl's fully-async script: this checkout against
an earlier one.

    python bench/rank_memory.py [--baseline e145e65] [--steps 5] [--batch 128] [key=value ...]

verl's Qwen3-30B-A3B fully-async script (tests/data/verl/fully_async_dapo_30b_a3b_base_math_fsdp.sh)
as `python -m dapo_megatron.tools.from_verl` translates it, with the tiny assets for its paths and
model and its four resource keys set to one machine (one training rank, a TP4 engine), as
docs/async.md runs it; `--batch` prompts a step (the script's 512 take ~1 min a step here) in
mini-batches of its 32, each trained as its groups arrive (16 responses, packed up to 22528 tokens
a micro-batch). Each tree runs it once; the training rank's RSS is read every 0.5 s. Per step: the
rank's peak RSS inside the step and its RSS at the step's end; then the growth per step from
step 2's end to the last (step 1 builds the optimizer's state), and the update's median time.
e145e65 is the checkout before the rank handed glibc's free heap pages back at each phase's end
(`TrainWorker._phase_end`) and ran with oneDNN's primitive cache off (the CPU device's `rank_env`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time

import psutil

from _trees import HERE, checkouts
from common import read_metrics, run_main
from process_memory import TreeSampler, role
from results import Table, write

SCRIPT = os.path.join(HERE, "tests", "data", "verl", "fully_async_dapo_30b_a3b_base_math_fsdp.sh")
# the script's resource keys for one machine (docs/async.md), and its paths as the tiny assets
RESOURCES = {"n_gpus_rollout": "4", "n_gpus_training": "1", "n_nodes_rollout": "1", "n_nodes_train": "1"}
PATHS = {"MODEL_PATH": "tiny://qwen3_moe", "TRAIN_FILE": "tiny://data/train.parquet",
         "TEST_FILE": "tiny://data/val.parquet", "CKPTS_DIR": "unused"}


def overrides() -> list[str]:
    """The script's command in our keys (the checkpoint directory and the logger are the run's)."""
    from dapo_megatron.config.verl_compat import ordered_overrides, resolve
    from dapo_megatron.tools.from_verl import parse_script
    text = open(SCRIPT).read()
    for key, value in RESOURCES.items():
        text, n = re.subn(rf"^{key}=\S+", f"{key}={value}", text, flags=re.M)
        assert n == 1, key
    ours = ordered_overrides(resolve(parse_script(text, PATHS)[0]))
    return [o for o in ours if not o.startswith(("trainer.default_local_dir=", "trainer.logger="))]


class RankRss(TreeSampler):
    """(time, the training rank's RSS in GB) every `every_s` while the run's tree lives."""

    def __init__(self, root: int, every_s: float = 0.5):
        super().__init__(root, every_s)
        self.samples: list[tuple[float, float]] = []

    def read(self, procs: list[psutil.Process]) -> None:
        rss = []
        for p in procs:
            if role(p) == "ray::TrainWorker":
                try:
                    rss.append(p.memory_info().rss / 2**30)
                except psutil.Error:
                    continue
        if rss:
            self.samples.append((time.time(), max(rss)))


def per_step(out: str, samples: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(peak RSS inside the step, RSS at its end) per step, by the phases' end times."""
    ends: dict[int, float] = {}
    for line in open(os.path.join(out, "phases.jsonl")):
        p = json.loads(line)
        if p["step"] > 0:
            ends[p["step"]] = max(ends.get(p["step"], 0.0), p["end"])
    rows, start = [], samples[0][0] if samples else 0.0
    for step in sorted(ends):
        inside = [rss for t, rss in samples if start < t <= ends[step]]
        rows.append((max(inside, default=0.0), inside[-1] if inside else 0.0))
        start = ends[step]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="e145e65", help="a commit, or none")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=128, help="data.train_batch_size (the script's: 512)")
    p.add_argument("ours", nargs="*", help="key=value for every run")
    args = p.parse_args()
    common = [*overrides(), f"data.train_batch_size={args.batch}", f"trainer.total_training_steps={args.steps}",
              "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_freq=0",
              "trainer.logger=[jsonl]", "trainer.resume_mode=disable", *args.ours]
    rows, found = [], {}
    with tempfile.TemporaryDirectory() as tmp, checkouts(args.baseline, tmp) as trees:
        for i, (name, tree) in enumerate(trees):
            out, samplers = os.path.join(tmp, f"run{i}"), []

            def start(proc) -> None:
                samplers.append(RankRss(proc.pid))
                samplers[0].start()
            try:
                run_main("dapo", common, out_dir=out, tree=tree, timeout=3600, on_start=start)
            finally:
                for s in samplers:
                    s.stop.set()
                    s.join()
            steps = per_step(out, samplers[0].samples)
            found[name] = steps
            update = statistics.median(r["timing/update"] for r in read_metrics(out)[1:])
            growth = (steps[-1][1] - steps[1][1]) / (len(steps) - 2) if len(steps) > 2 else 0.0
            cells = [f"{peak:.2f} / {end:.2f}" for peak, end in steps[:args.steps]]
            cells += ["(stopped)"] * (args.steps - len(cells))  # a run killed for host memory
            rows.append([name, *cells, f"{growth * 1024:+.0f}", f"{update:.1f}"])
            print(rows[-1], flush=True)
    write("rank_memory", title="A training rank's host memory, step by step, on verl's fully-async script",
          measures="verl's Qwen3-30B-A3B fully-async script translated by from_verl, the tiny assets, one training "
                   f"rank and a TP4 engine on one machine, {args.batch} prompts x 16 responses a step in mini-batches "
                   "of 32 streamed; the training rank's RSS read every 0.5 s, per step its peak and its value at the "
                   "step's end, each checkout run once.",
          tables=[Table("steps", f"The training rank's RSS (GB), peak / at the step's end, {args.steps} steps",
                        ["checkout", *(f"step {k + 1}" for k in range(args.steps)), "MB a step after step 2",
                         "update s (median, steps 2..)"],
                        rows)],
          extra={"per_step": found, "overrides": common})


if __name__ == "__main__":
    main()
