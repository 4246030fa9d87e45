"""The memory plan against what a CPU rank holds, and the plan of every shipped 30B config.

    python bench/memory_plan.py [--lengths 1024,1536] [--rows 2]

Part 1 builds a MoE model (hidden 512, expert FFN 352, dense FFN 1408, GQA 8:2, 8 experts top-2,
a 32k vocabulary), takes one fp32 update per length on one gloo rank and measures its peak
resident set above the idle baseline (tests/distributed/memory_jobs.py: RSS sampled every 2 ms,
glibc mmaps blocks > 64 KiB so frees leave the RSS); prints the plan's activation and logits
terms (plan/activations.py, the CPU's unfused attention), the measurement, their ratio, and the
ratio of the slopes between the lengths. Part 2 prints each 30B config's plan per phase: a
run's start-up, resume and restart, then a step's phases (plan/__init__.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from results import Table, write

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "distributed"))

GB = 1e9


def measured_vs_planned(lengths: list[int], rows: int) -> list[list]:
    """Prints the plan's terms against the measured peak per length; returns the `cpu` table's rows."""
    import memory_jobs

    from dapo_megatron.assets.models import build_tiny_model
    from dapo_megatron.config.schema import ParallelConfig
    from dapo_megatron.models.spec import ModelSpec
    from dapo_megatron.plan.activations import shape_of, training_bytes
    from dapo_megatron.train.parallel import run_workers
    hf = build_tiny_model("qwen3_moe", tempfile.mkdtemp(prefix="plan_moe_"), vocab_size=32000, hidden_size=512,
                          intermediate_size=1408, moe_intermediate_size=352, num_experts=8, num_experts_per_tok=2,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                          max_position_embeddings=max(lengths) * 2)
    spec = ModelSpec.from_pretrained(hf)
    shape = shape_of(spec, ParallelConfig(), dtype_bytes=4)
    peaks = run_workers(memory_jobs.activation_peaks, 1, hf, lengths, rows, timeout_s=1200)[0]
    print(f"{'tokens':>8}{'activations GB':>16}{'logits GB':>11}{'planned GB':>12}{'measured GB':>13}{'ratio':>7}")
    planned = []
    for length, peak in zip(lengths, peaks):
        t = training_bytes(shape, layers=spec.num_layers, in_flight=1, tokens=rows * length, seq_len=length,
                           flash=False, recompute="", last_stage=True, entropy_grad=True)
        planned.append(sum(t.values()))
        print(f"{rows * length:>8}{t['activations'] / GB:>16.3f}{t['logits'] / GB:>11.3f}{planned[-1] / GB:>12.3f}"
              f"{peak / GB:>13.3f}{planned[-1] / peak:>7.3f}")
    table = [[rows * length, f"{plan / GB:.2f}", f"{peak / GB:.2f}", f"{plan / peak:.3f}"]
             for length, plan, peak in zip(lengths, planned, peaks)]
    for i in range(1, len(lengths)):
        slope = (planned[i] - planned[i - 1]) / (peaks[i] - peaks[i - 1])
        print(f"slope {lengths[i - 1]} -> {lengths[i]}: planned / measured {slope:.3f}")
        table.append([f"slope {rows * lengths[i - 1]} -> {rows * lengths[i]}", "-", "-", f"{slope:.3f}"])
    return table


def shipped_configs() -> tuple[list[str], list[list], str]:
    """Prints each 30B config's plan per phase; returns the `configs` table's phase names and rows
    (a row per config: GiB per phase, the peak's verdict, the largest max_response_length that
    fits) and the peaks in a line."""
    from dapo_megatron.config import available_configs, load_config
    from dapo_megatron.plan import GiB, make_plan, max_response_length
    from dapo_megatron.plan.__main__ import model_spec
    plans = {}
    for name in (n for n in available_configs() if "30b" in n):
        cfg = load_config(name, [])
        memory = (64 if "npu" in name else 80) * GiB
        plans[name] = (make_plan(cfg, model_spec(cfg), memory), max_response_length(cfg, model_spec(cfg), memory))
        print(f"{name} ({memory / GiB:.0f} GiB): " + ", ".join(f"{p.name} {p.total / GiB:.1f}"
                                                               for p in plans[name][0].phases))
    phases = list(dict.fromkeys(p.name for plan, _ in plans.values() for p in plan.phases))
    table, peaks = [], []
    for name, (plan, longest) in plans.items():
        by = {p.name: f"{p.total / GiB:.1f}" for p in plan.phases}
        peak, memory = plan.peak, plan.device_bytes / GiB
        verdict = f"{peak.name} {peak.total / GiB:.1f} / {memory:.0f}: " + (
            f"fits, {1 - peak.total / plan.device_bytes:.0%} free" if plan.fits else "DOES NOT FIT")
        table.append([f"`{name}` ({memory:.0f} GiB)", *(by.get(ph, "-") for ph in phases), verdict, longest])
        peaks.append(f"{name}: {peak.name} {peak.total / GiB:.1f} / {memory:.0f}")
    return phases, table, "; ".join(peaks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,1536")
    p.add_argument("--rows", type=int, default=2)
    args = p.parse_args()
    cpu = measured_vs_planned([int(x) for x in args.lengths.split(",")], args.rows)
    phases, configs, peaks = shipped_configs()
    ratios = [row[-1] for row in cpu if not str(row[0]).startswith("slope")]
    write("memory_plan", summary=f"plan / measured on a CPU rank {min(ratios)}-{max(ratios)}; peaks {peaks}",
          title="The memory plan against a CPU rank, and the shipped 30B configs' plans",
          measures="The plan's activation and logits terms against the peak resident set of an fp32 update on one "
                   "CPU rank, and the plan of every shipped 30B config per phase: a run's start-up, resume and "
                   "restart, then a step's phases and a dead engine's replacement.",
          tables=[Table("configs", "The plan of each shipped 30B config, GiB per device in each phase, in the order a "
                        "run meets them: start-up, resume, restart, then a step's (no device needed); max response: "
                        "the largest `data.max_response_length` that fits at the config's other settings",
                        ["config (device)", *phases, "peak", "max response"],
                        configs),
                  Table("cpu", f"The plan's activation + logits terms against the peak RSS of an fp32 update above its "
                        f"idle baseline on one CPU rank ({args.rows} rows a length)",
                        ["tokens", "planned (GB)", "measured (GB)", "planned / measured"], cpu)])


if __name__ == "__main__":
    main()
