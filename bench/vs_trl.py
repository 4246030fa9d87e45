"""TRL's DAPO trainer against our quickstart, as a sweep: model size x response length, alternated in one run.

    python bench/vs_trl.py [--quick] [--models 1m 10m 40m] [--lengths demo 128] [--rounds 1] [--steps N]

Each cell runs `--rounds` x (TRL, ours) on the same model, data, reward and batch, dynamic sampling
off: the demo's own model (~1M parameters) and ~10M / ~40M Qwen3-MoE built here by our assets code
(random init: this measures speed, not learning), with the demo's responses (up to 16 tokens,
ending at EOS) or 128 tokens forced on both sides (ours `rollout.ignore_eos`, TRL
`min_new_tokens`). It prints and records responses/s (responses trained per second of step time)
and generated tokens/s, the step's anatomy (median over the steps after the warm-up), the peak PSS
summed over each run's process tree, per cell the ratios ours / TRL against the targets, and a
PNG of the ratio against model size. `--quick`: the 1M cells only. TRL's settings are derived from
our quickstart config (refused if it drifts from what TRL can mirror); TRL runs in a venv of its
own, made on first use under ~/.cache/dapo-megatron/bench/trl-venv, never in ours.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import psutil

from common import median, run_main  # bench/ is this script's folder: on sys.path
from dapo_megatron.assets import resolve_asset_path
from dapo_megatron.config import load_config
from process_memory import pss_mb
from results import Table, write

ROOT = Path(__file__).resolve().parent.parent
# The sweep's models: None is the demo's own (tiny://qwen3_moe, ~1.1M parameters); the others are
# Qwen3-MoE overrides of assets.models' tiny config (its vocabulary and special tokens kept), hidden,
# dense and expert FFN sizes all different, GQA.
MODELS: dict[str, dict | None] = {
    "1m": None,
    "10m": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=224, num_hidden_layers=6,
                num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2),
    "40m": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=384, num_hidden_layers=7,
                num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2),
}
LENGTHS = {"demo": None, "128": 128}  # None: the quickstart's max_response_length, ending at EOS
STEPS = {"1m": 12, "10m": 8, "40m": 5}  # a cell's steps (the first WARMUP_STEPS not timed)
# Targets per cell (issue #77): the demo cell >= 1.0x TRL's responses/s and <= 2.5x its peak PSS;
# every 128-token cell >= 1.0x; the ~40M cells >= 2x with <= 1.5x TRL's memory.
TARGETS = {("1m", "demo"): (1.0, 2.5), ("40m", "demo"): (2.0, 1.5), ("40m", "128"): (2.0, 1.5)}
TRL_VENV = Path.home() / ".cache" / "dapo-megatron" / "bench" / "trl-venv"
TRL_VERSION = "1.16.0"
WARMUP_STEPS = 2
PHASES = ("gen", "score", "old_logprob", "update", "sync", "other")
OURS = ["algorithm.filter_groups.enable=false", "trainer.save_freq=0", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.resume_mode=disable"]
NOTES = """\
What differs between the two setups (everything else is set equal from configs/quickstart.yaml):
- generation: TRL = HF `generate` in the training process (padded batch, KV cache, no weight sync);
  ours = a vLLM-CPU engine in its own process, weights synced after every update (`sync`).
- processes: TRL = one process; ours = Ray driver + 2 Megatron ranks (EP=2) + vLLM engine + rollout
  manager (the reward worker and, in the lean layout, the data plane in it; the reward pool a
  process) + Ray's daemons. PSS counts all of them (libraries shared between them once).
- model: the demo's own (warm-started) or a random-init Qwen3-MoE of the sweep (MODELS), the same
  folder on both sides; 128-token cells force the length on both (ignore_eos / min_new_tokens).
- scoring: same `math_score.score`; TRL calls it in-process, ours in a reward-pool worker with a
  2 s deadline. Ours' `gen` includes the Ray calls around scoring; `score` is the scoring itself.
- update: TRL runs the 128 responses as one micro-batch; ours packs micro-batches of <= 4096 tokens
  per rank and offloads params/grads/optimizer to host copies around generation (`other`).
- MoE: TRL = HF Qwen3-MoE experts in eager PyTorch; ours = Megatron-Core MoE, experts split over
  2 ranks. Neither has an aux loss (TRL's router_aux_loss_coef forced to 0 to match).
- sampling: different RNGs and prompt order (ours: data.seed, vLLM seeds; TRL: its RepeatSampler
  and seed): the rewards differ step by step, not in distribution; each side repeats itself run to run.
- threads: TRL = torch's default (all cores) in one process; ours = one per training rank (cores /
  ranks) and vLLM-CPU's own OpenMP binding in the engine (the phases take turns).
TRL: gen = `_generate_and_score_completions` minus `_calculate_rewards` (tokenize, generate,
decode, advantages), update = the rest of the step (loss, backward, optimizer)."""


def trl_python() -> str:
    """The TRL venv's python, made on first use: torch first (our local CPU wheel, so pip never
    pulls a CUDA build), then TRL with our transformers and math-verify pins."""
    python, done = TRL_VENV / "bin" / "python", TRL_VENV / ".installed"
    if not done.exists():
        print(f"installing TRL {TRL_VERSION} into {TRL_VENV} (once)", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(TRL_VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        torch_pin = f"torch=={version('torch').split('+')[0]}"
        subprocess.run(pip + [torch_pin], check=True)
        subprocess.run(pip + [torch_pin, f"trl=={TRL_VERSION}", f"transformers=={version('transformers')}",
                              f"math-verify=={version('math-verify')}"], check=True)
        done.touch()
    return str(python)


def target(model: str, length: str) -> tuple[float, float | None]:
    """(least responses/s ratio, most peak-PSS ratio or None) the cell is held to."""
    if (model, length) in TARGETS:
        return TARGETS[model, length]
    return (1.0, None) if length == "128" else (0.0, None)


def build_model(name: str, tmp: Path) -> str | None:
    """The sweep's model `name` as an HF folder (random init, the demo's tokenizer files beside it);
    None: the demo's own."""
    if MODELS[name] is None:
        return None
    import shutil

    from transformers import AutoConfig

    from dapo_megatron.assets.models import build_tiny_model
    demo = resolve_asset_path(load_config("quickstart").model.path)
    base = AutoConfig.from_pretrained(demo)
    out = tmp / f"model-{name}"
    build_tiny_model("qwen3_moe", str(out), vocab_size=base.vocab_size, seed=0,
                     special_token_ids={k: getattr(base, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
                     **MODELS[name])
    for f in Path(demo).iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    return str(out)


def parameters(path: str) -> int:
    from safetensors import safe_open
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def trl_settings(cfg, steps: int) -> dict:
    """GRPOConfig keys equal to our effective config. What TRL cannot mirror is refused here."""
    a, o, r = cfg.actor, cfg.actor.optim, cfg.rollout
    same = {"model.dtype fp32": cfg.model.dtype == "fp32",
            "actor.loss_agg_mode token-mean": a.loss_agg_mode == "token-mean",
            "actor.policy_loss dapo": a.policy_loss == "dapo", "actor.use_kl_loss false": not a.use_kl_loss,
            "one optimizer step per step": a.ppo_mini_batch_size == cfg.data.train_batch_size,
            "no lr warm-up, constant lr": o.lr_warmup_steps == 0 and o.lr_scheduler == "constant",
            "reward.overlong_buffer off": not cfg.reward.overlong_buffer.enable}
    if not all(same.values()):
        raise SystemExit(f"vs_trl: TRL's setup cannot mirror the quickstart: {[k for k, v in same.items() if not v]}")
    return {"model": resolve_asset_path(cfg.model.path), "train_file": resolve_asset_path(cfg.data.train_files[0]),
            "grpo": dict(loss_type="dapo", beta=0.0, num_generations=r.n, max_steps=steps,
                         per_device_train_batch_size=cfg.data.train_batch_size * r.n,  # one generation batch
                         num_iterations=a.ppo_epochs, max_completion_length=cfg.data.max_response_length,
                         temperature=r.temperature, top_p=r.top_p, top_k=max(r.top_k, 0),
                         learning_rate=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0],
                         adam_beta2=o.betas[1], max_grad_norm=o.clip_grad, epsilon=a.clip_ratio_low,
                         epsilon_high=a.clip_ratio_high, delta=a.clip_ratio_c,  # delta: TRL's dual clip
                         scale_rewards="group" if cfg.algorithm.norm_adv_by_std_in_grpo else "none",
                         router_aux_loss_coef=0.0, seed=cfg.trainer.seed,
                         generation_kwargs={"min_new_tokens": cfg.data.max_response_length} if r.ignore_eos else None)}


def tree_pss_gb(root: int) -> float:
    """PSS summed over `root` and its descendants (a local Ray cluster's daemons and workers, and
    vLLM's engine core, are all children of the driver): shared pages are counted once in total."""
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    return sum(pss_mb(p.pid) for p in procs) / 1024


def watch_pss(proc: subprocess.Popen, peaks: list) -> None:
    """Sample `proc`'s tree PSS every 0.5 s until it exits; its peak (GB) appended to `peaks`."""
    peak = 0.0
    while proc.poll() is None:
        peak = max(peak, tree_pss_gb(proc.pid))
        time.sleep(0.5)
    peaks.append(peak)


def run_measured(cmd: list[str], out: Path) -> float:
    """Run `cmd` (TRL's side) to the end with its output in out/run.log; returns its peak tree
    PSS (GB), sampled every 0.5 s as `run_ours` samples ours."""
    out.mkdir(parents=True, exist_ok=True)
    peaks: list = []
    with open(out / "run.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        watch_pss(proc, peaks)
    if proc.returncode:
        tail = (out / "run.log").read_text().splitlines()[-30:]
        raise SystemExit(f"vs_trl: {' '.join(cmd[:3])} ... exited {proc.returncode}:\n" + "\n".join(tail))
    return peaks[0]


def run_trl(settings: dict, out: Path) -> tuple[list[dict], float]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(settings))
    peak = run_measured([trl_python(), str(ROOT / "bench" / "_trl_side.py"), str(out / "settings.json"), str(out)], out)
    rows = []
    for r in (json.loads(line) for line in open(out / "steps.jsonl")):
        rows.append({"step": r["step"], "reward": r["reward"], "gen": r["gen_and_score"] - r["score"],
                     "score": r["score"], "update": r["step_s"] - r["gen_and_score"], "step_s": r["step_s"],
                     "length": r["length"]})
    return rows, peak


def run_ours(overrides: list[str], out: Path, steps: int, groups: int) -> tuple[list[dict], float]:
    out.mkdir(parents=True, exist_ok=True)
    peaks: list = []
    run = run_main("quickstart", [*overrides, f"trainer.total_training_steps={steps}"], out_dir=str(out), tree=str(ROOT),
                   log=str(out / "run.log"), on_start=lambda proc: watch_pss(proc, peaks))
    rows = []
    for m in run.metrics():
        if m.get("sampling/generated_groups", groups) != groups:  # TRL generates exactly the trained batch
            raise SystemExit(f"vs_trl: step {m['step']} generated {m['sampling/generated_groups']:.0f} groups, "
                             f"trained {groups}: check data.gen_batch_size")
        score = m.get("timing/reward", 0.0)  # scored once per step, after generation, inside timing/gen
        rows.append({"step": m["step"], "reward": m["reward/mean"], "gen": m["timing/gen"] - score, "score": score,
                     **{k: m.get(f"timing/{k}", 0.0) for k in ("old_logprob", "update", "sync")},
                     "step_s": m["timing/step"], "length": m["response_length/mean"]})
    return rows, peaks[0]


def summary(rows: list[dict], responses: int, peak: float) -> dict:
    """Medians over the steps after the warm-up; `other` is what the named phases leave of a step."""
    timed = rows[WARMUP_STEPS:] or rows
    med = {k: median(timed, k) for k in ("step_s", *PHASES[:-1])}
    med["other"] = median(r["step_s"] - sum(r.get(k, 0.0) for k in PHASES[:-1]) for r in timed)
    return {**med, "responses/s": median(responses / r["step_s"] for r in timed),
            "tokens/s": median(responses * r["length"] / r["gen"] for r in timed), "pss_gb": peak}


def run_cell(cfg_overrides: list[str], settings: dict, model: str, length: str, rounds: int, steps: int,
             responses: int, groups: int, tmp: Path) -> list[tuple[str, dict, list[dict]]]:
    runs = []
    for r in range(1, rounds + 1):
        for side, run in (("TRL", lambda out: run_trl(settings, out)),
                          ("ours", lambda out: run_ours(cfg_overrides, out, steps, groups))):
            print(f"{model} x {length}, round {r}: {side} ...", file=sys.stderr, flush=True)
            rows, peak = run(tmp / f"{model}-{length}-{side}-{r}")
            runs.append((f"{side}, {r}", summary(rows, responses, peak), rows))
    return runs


def ratio(runs, key: str) -> float:
    by = {side: [s for n, s, _ in runs if n.startswith(side)] for side in ("TRL", "ours")}
    return median(s[key] for s in by["ours"]) / median(s[key] for s in by["TRL"])


def plot(cells: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, length in enumerate(dict.fromkeys(c["length"] for c in cells)):
        mine = [c for c in cells if c["length"] == length]
        ax.plot([c["params"] / 1e6 for c in mine], [c["rate"] for c in mine], "o-", color=f"C{i}",
                label=f"responses: {'the demo' + chr(39) + 's (<= 16 tokens)' if length == 'demo' else length + ' tokens'}")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xscale="log", xlabel="model parameters (millions)", ylabel="ours / TRL, responses trained per second")
    ax.legend(fontsize=8)
    ax.set_title("Our quickstart against TRL's DAPO trainer, one 2-core machine", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=90)


def report(cells: list[dict], rounds: int, plot_path: str, plot_name: str) -> None:
    rows, phase_rows, lines = [], [], []
    for c in cells:
        least, most = c["target"]
        met = c["rate"] >= least and (most is None or c["pss"] <= most)
        goal = (f">= {least:g}x" if least else "-") + (f", PSS <= {most:g}x" if most else "")
        rows.append([c["model"], round(c["params"] / 1e6, 1), c["length"], round(c["trl"]["responses/s"], 1),
                     round(c["ours"]["responses/s"], 1), round(c["rate"], 2), round(c["trl"]["tokens/s"]),
                     round(c["ours"]["tokens/s"]), round(c["trl"]["pss_gb"], 2), round(c["ours"]["pss_gb"], 2),
                     round(c["pss"], 2), goal, ("met" if met else "missed") if least else "-"])
        for side in ("trl", "ours"):
            s = c[side]
            phase_rows.append([c["model"], c["length"], "TRL" if side == "trl" else "ours", round(s["step_s"], 3),
                               *(round(s[k], 3) if s[k] else "-" for k in ("gen", "score")),
                               round(s["old_logprob"] + s["update"], 3), *(round(s[k], 3) if s[k] else "-" for k in
                                                                          ("sync", "other"))])
        lines.append(f"{c['model']} x {c['length']}: {c['rate']:.2f}x responses/s, {c['pss']:.2f}x peak PSS "
                     f"({'met' if met else 'missed'} {goal})" if least else
                     f"{c['model']} x {c['length']}: {c['rate']:.2f}x responses/s, {c['pss']:.2f}x peak PSS")
    tables = []
    demo = next((c for c in cells if (c["model"], c["length"]) == ("1m", "demo")), None)
    if demo is not None:  # the one cell that learns (the demo's warm-started model): reward over steps
        stride = max(1, demo["steps"] // 3)
        windows = [(lo, min(lo + stride - 1, demo["steps"])) for lo in range(1, demo["steps"] + 1, stride)]
        tables.append(Table("reward", "The demo cell's mean reward over steps, the same runs",
                            ["run", *(f"steps {lo}-{hi}" for lo, hi in windows)],
                            [[r["run"], *(round(statistics.fmean(x["reward"] for x in r["rows"] if lo <= x["step"] <= hi), 2)
                                          for lo, hi in windows)] for r in demo["runs"]]))
    for line in lines:
        print(line)
    print("\n" + NOTES)
    plot(cells, plot_path)
    write("vs_trl", title="TRL's DAPO trainer against our quickstart",
          measures="TRL's GRPOTrainer(loss_type=\"dapo\") against our quickstart on the same model, data, reward and "
                   "batch, alternated in one run per cell of a sweep (model size x response length): responses trained "
                   "per second, generated tokens per second of generation, the step by phase, the peak PSS of each "
                   "run's process tree.",
          tables=[Table("cells", f"Ours / TRL by model and response length ({rounds} round(s) each, medians of the "
                        f"steps after {WARMUP_STEPS} warm-up steps)",
                        ["model", "M params", "responses", "TRL resp/s", "ours resp/s", "ratio", "TRL gen tok/s",
                         "ours gen tok/s", "TRL PSS GB", "ours PSS GB", "PSS ratio", "target", "verdict"], rows,
                        "responses: the demo's (up to 16 tokens, ending at EOS) or 128 forced on both sides; gen "
                        "tok/s: generated tokens per second of the generation phase"),
                  Table("phases", "The step by phase, s (medians; update: ours' old-log-prob pass, when it runs one, "
                        "and update)", ["model", "responses", "side", "step", "generation", "scoring", "update",
                                        "weight sync", "rest"], phase_rows), *tables],
          plots=[plot_name], summary="; ".join(lines), extra={"notes": NOTES, "cells": cells})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the 1M cells only")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--lengths", nargs="+", default=list(LENGTHS), choices=list(LENGTHS))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=0, help="steps a run (0: per model, STEPS)")
    p.add_argument("--plot", default="bench/plots/vs_trl.png", help="relative to the repository's root")
    args = p.parse_args()
    models = ["1m"] if args.quick else args.models
    trl_python()  # the one-time install stays out of the first cell
    cells = []
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        for model in models:
            path = build_model(model, Path(tmp))
            for length in args.lengths:
                extra = ([f"model.path={path}"] if path else []) + (
                    [f"data.max_response_length={LENGTHS[length]}", "rollout.ignore_eos=true"] if LENGTHS[length] else [])
                cfg = load_config("quickstart", OURS + extra)
                # Generate exactly the batch that is trained: the quickstart's gen_batch_size surplus
                # only feeds dynamic sampling, which is off here.
                overrides = OURS + extra + [f"data.gen_batch_size={cfg.data.train_batch_size}"]
                steps = args.steps or STEPS[model]
                settings = trl_settings(cfg, steps)
                responses = cfg.data.train_batch_size * cfg.rollout.n
                runs = run_cell(overrides, settings, model, length, args.rounds, steps, responses,
                                cfg.data.train_batch_size, Path(tmp))
                side = {k: {key: median(s[key] for n, s, _ in runs if n.startswith(name)) for key in runs[0][1]}
                        for k, name in (("trl", "TRL"), ("ours", "ours"))}
                cells.append({"model": model, "length": length, "params": parameters(settings["model"]),
                              "steps": steps, "trl": side["trl"], "ours": side["ours"],
                              "rate": ratio(runs, "responses/s"), "pss": ratio(runs, "pss_gb"),
                              "target": target(model, length),
                              "runs": [{"run": n, **s, "rows": rows} for n, s, rows in runs]})
    report(cells, args.rounds, str(ROOT / args.plot) if not os.path.isabs(args.plot) else args.plot, args.plot)


if __name__ == "__main__":
    main()
