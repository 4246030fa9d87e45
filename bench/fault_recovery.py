"""Recovery times on the quickstart: a rollout engine and a training rank killed -9 mid-step.

    python bench/fault_recovery.py [--steps 8] [--at 5] [--kill engine,rank] [--baseline COMMIT]

Two runs of the quickstart as a user starts it (`python -m dapo_megatron.main`, no validation):
  engine: rollout.max_engine_restarts=1, the engine's process killed once it has requests of step
          `--at`'s generation (tests/faults.py's engine:collect); the step goes on with a replacement.
  rank:   trainer.max_restarts=1 and a checkpoint every 2 steps; training rank 0's process killed
          in step `--at`'s update (found by its process title); the run restarts itself from the
          newest checkpoint (since 2026-11-29 with new training ranks beside the roles it keeps).
  rank-sync: the same, killed in the step's weight push (roles kept since 6221d82).
`--baseline COMMIT` runs the same first from that commit (a temporary git worktree).
For each: the time from the kill to serving again (engine: the replacement holds the weights and
takes requests; rank: the restarted run's first phase done), to the end of the next finished
step (its `sync` phase in phases.jsonl), and that less a median step (the time lost, about). Prompts: each step took from
the stream exactly the prompts it scored (`data/prompts_consumed` against generated groups).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time

import psutil
from _trees import checkouts
from common import NO_EVAL, median, read_metrics, run_main
from results import Table, write


def _lines(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def _run(tree: str, out: str, steps: int, overrides: list[str], env: dict, on_start=None, entry=None) -> None:
    run_main("quickstart", [f"trainer.total_training_steps={steps}", *NO_EVAL, *overrides], out_dir=out, tree=tree,
             env={"RAY_ADDRESS": "local", **env}, timeout=1800, on_start=on_start, entry=entry)


def _kill_rank_in(method: str, out: str, step: int, killed: list) -> threading.Thread:
    """kill -9 a training rank once `step - 1` steps are logged and it runs `method` (its process
    title: a scan, not the driver's DAPO_KILL_ROLE_AT hook, which a baseline may lack)."""
    def watch():
        metrics = os.path.join(out, "metrics.jsonl")
        while len(read_metrics(metrics)) < step - 1:
            time.sleep(0.05)
        while not killed:
            for proc in psutil.process_iter(["cmdline"]):
                if " ".join(proc.info["cmdline"] or []).startswith(f"ray::TrainWorker.{method}"):
                    os.kill(proc.pid, signal.SIGKILL)
                    killed.append(time.time())
                    return
            time.sleep(0.02)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _summary(what: str, out: str, kill_at: float, back_at: float) -> dict:
    rows, phases = read_metrics(out), _lines(os.path.join(out, "phases.jsonl"))
    done = min(p["end"] for p in phases if p["phase"] == "sync" and p["end"] > kill_at)
    steps = {}
    for r in rows:  # the last row of a step (a restarted run logs its steps again)
        steps[r["step"]] = r
    step_s = median(r["timing/step"] for r in steps.values())
    consumed = [r["data/prompts_consumed"] for r in sorted(steps.values(), key=lambda r: r["step"])]
    generated = [r["sampling/generated_groups"] for r in sorted(steps.values(), key=lambda r: r["step"])]
    exact = consumed[0] == generated[0] and all(b - a == g for a, b, g in zip(consumed, consumed[1:], generated[1:]))
    return {"what": what, "to_serving": back_at - kill_at, "to_step": done - kill_at,
            "median_step": step_s, "steps": len(steps), "exact": exact}


def _engine(tree: str, out: str, args) -> dict:
    # the kill is a hook tests/faults.py installs; a tree from before it read DAPO_KILL_ENGINE_AT
    faults = os.path.join(tree or os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "faults.py")
    if os.path.exists(faults):
        _run(tree, out, args.steps, ["rollout.max_engine_restarts=1"], {"DAPO_TEST_FAULTS": f"engine:collect:{args.at}"},
             entry=faults)
    else:
        _run(tree, out, args.steps, ["rollout.max_engine_restarts=1"], {"DAPO_KILL_ENGINE_AT": str(args.at)})
    (event,) = _lines(os.path.join(out, "events.jsonl"))
    died = event["time"] - event["since_death_s"]  # the manager saw the death (~ms after the kill)
    return _summary("rollout engine (replaced in the step)", out, died, event["time"])


def _rank(tree: str, out: str, args, method: str = "step_update", where: str = "update") -> dict:
    killed: list = []
    _run(tree, out, args.steps, ["trainer.max_restarts=1", "trainer.save_freq=2"], {},
         on_start=lambda _: _kill_rank_in(method, out, args.at, killed))
    (event,) = _lines(os.path.join(out, "events.jsonl"))
    resumed = min(ph["end"] for ph in _lines(os.path.join(out, "phases.jsonl")) if ph["end"] > event["time"])
    how = "new ranks, the other roles kept" if event.get("kept") else "every role restarted"
    return _summary(f"training rank in the {where} (run restarted from its checkpoint: {how})", out, killed[0],
                    resumed)


KILLS = {"engine": _engine, "rank": _rank,
         "rank-sync": lambda tree, out, args: _rank(tree, out, args, "push_weights", "weight push")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--at", type=int, default=5)
    p.add_argument("--kill", default="engine,rank", help=f"the roles killed, a run each: {', '.join(KILLS)}")
    p.add_argument("--baseline", default="none", help="a commit run first, from a git worktree; none: this checkout")
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as root, checkouts(args.baseline, root) as trees:
        for name, tree in trees:
            for kill in args.kill.split(","):
                results.append({**KILLS[kill](tree, os.path.join(root, f"{kill}-{len(results)}"), args), "tree": name,
                                "kill": kill})
    print(f"\nrecovery on the quickstart, kill -9 in step {args.at} of {args.steps}")
    head = ("checkout", "killed", "kill -> serving again s", "kill -> next step done s", "median step s", "lost ~ s",
            "steps logged", "prompts exact")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in results:  # lost: past what a step takes anyway
        print(f"| {r['tree']} | {r['what']} | {r['to_serving']:.1f} | {r['to_step']:.1f} | {r['median_step']:.2f} | "
              f"{r['to_step'] - r['median_step']:.1f} | {r['steps']} | {r['exact']} |")
    columns = ["run", "killed", "kill -> serving again", "kill -> step done", "median step", "lost, about", "prompts"]
    rows = {kill: [[r["tree"], r["what"], f"{r['to_serving']:.1f} s", f"{r['to_step']:.1f} s", f"{r['median_step']:.2f} s",
                    f"{r['to_step'] - r['median_step']:.1f} s", "exact" if r["exact"] else "NOT exact"]
                   for r in results if r["kill"] == kill] for kill in KILLS}
    title = f"Killed -9 in step {args.at} of {args.steps} of the quickstart"
    tables = [Table("recovery", title, columns, rows["engine"] + rows["rank"])] if rows["engine"] + rows["rank"] else []
    if rows["rank-sync"]:
        tables.append(Table("in_sync", f"Training rank 0 killed -9 in the weight push, step {args.at} of {args.steps}",
                            columns, rows["rank-sync"]))
    write("fault_recovery", title="Recovery from a killed role",
          measures="A rollout engine and a training rank killed -9 mid-step of the quickstart, a run each: the time "
                   "from the kill to serving again and to the next finished step, and that less a median step.",
          tables=tables, extra={"runs": results})


if __name__ == "__main__":  # Ray and vLLM may spawn processes: the guard keeps them from re-running this
    main()
