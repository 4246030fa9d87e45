"""Per-step metrics: one console line, `metrics.jsonl`, TensorBoard, wandb, and a PNG of the curves.

The driver calls `log(step, metrics)` once per step, `plot_soon()` on save and `plot()` at the end. Sinks
are chosen by `trainer.logger`; wandb is used only when asked for AND installed (a missing wandb
is a warning, not a crash, since it is never required to train).
"""
from __future__ import annotations

import json
import math
import os
import re
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Sequence

import torch

# The console line shows these, in this order, when present.
CONSOLE_KEYS = ("reward/mean", "acc/mean", "val/acc", "response_length/mean", "actor/entropy", "actor/pg_clipfrac",
                "actor/grad_norm", "rollout/logprob_diff_max", "sampling/num_gen_batches", "timing/step")



def console_keys(values: dict) -> list[str]:
    """CONSOLE_KEYS that `values` has; a step validating n > 1 samples per prompt also shows its
    pass@n and maj@n after val/acc."""
    top = max((int(k.split("@")[1]) for k in values if re.fullmatch(r"val/(pass|maj)@\d+", k)), default=0)
    keys = list(CONSOLE_KEYS)
    keys[keys.index("val/acc") + 1:keys.index("val/acc") + 1] = [f"val/pass@{top}", f"val/maj@{top}"]
    return [k for k in keys if k in values]


# PNG panels: title -> metric keys drawn in it.
PLOT_PANELS: dict[str, tuple[str, ...]] = {
    "reward": ("reward/mean",),
    "accuracy": ("acc/mean", "val/acc"),
    "response length": ("response_length/mean",),
    "entropy": ("actor/entropy",),
    "timing (s)": ("timing/gen", "timing/update", "timing/sync", "timing/step"),
}


def _scalar(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class MetricsLogger:
    def __init__(self, out_dir: str, loggers: Sequence[str], *, project: str = "", experiment: str = "",
                 config: Mapping | None = None):
        self.out_dir = out_dir
        self.loggers = set(loggers)
        os.makedirs(out_dir, exist_ok=True)
        self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
        self._tb = self._wandb = None
        self._plotter: ThreadPoolExecutor | None = None  # plot_soon's thread, started on first use
        self._drawing = threading.Lock()  # matplotlib is not thread-safe: one figure at a time
        self._drawn: dict[str, tuple] = {}  # path -> the inputs it was last drawn from (_inputs)
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
        if "wandb" in self.loggers:
            try:
                import wandb
                self._wandb = wandb.init(project=project, name=experiment, config=dict(config or {}))
            except ImportError:
                warnings.warn("trainer.logger has 'wandb' but wandb is not installed; skipping it")

    def log(self, step: int, metrics: Mapping[str, object]) -> None:
        values = {k: v for k, v in ((k, _scalar(v)) for k, v in metrics.items()) if v is not None}
        if "jsonl" in self.loggers:
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps({"step": step, **values}) + "\n")
        shown = " ".join(f"{k}={values[k]:.4g}" for k in console_keys(values))
        if "console" in self.loggers and shown:  # nothing to show (no validation set at step 0): no line
            print(f"step {step}: {shown}", flush=True)
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def rewind(self, step: int) -> int:
        """The run goes on from a checkpoint of `step`: rows of later steps (trained by an attempt
        whose weights died with it) move to metrics.discarded.jsonl, so that metrics.jsonl and
        curves.png keep one row per step; TensorBoard hides its events past `step`. Returns the
        number of rows moved."""
        if self._tb is not None:  # a new event file whose purge hides what the old ones hold past `step`
            from torch.utils.tensorboard import SummaryWriter
            self._tb.close()
            self._tb = SummaryWriter(os.path.join(self.out_dir, "tensorboard"), purge_step=step + 1)
        if not os.path.exists(self.jsonl_path):
            return 0
        with open(self.jsonl_path) as f:
            lines = [line for line in f if line.strip()]
        later = [json.loads(line)["step"] > step for line in lines]
        if any(later):
            with open(os.path.join(self.out_dir, "metrics.discarded.jsonl"), "a") as f:
                f.writelines(line for line, gone in zip(lines, later) if gone)
            tmp = self.jsonl_path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(line for line, gone in zip(lines, later) if not gone)
            os.replace(tmp, self.jsonl_path)
        return sum(later)

    def history(self) -> list[dict]:
        if not os.path.exists(self.jsonl_path):
            return []
        with open(self.jsonl_path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def plot_soon(self):
        """plot() in a thread of its own: a save does not wait for matplotlib (~0.5 s a save here,
        1 s the first; the driver waits on its roles meanwhile). A failed drawing is a warning:
        the curves never stop a run. Returns the future (tests wait on it)."""
        if self._plotter is None:
            self._plotter = ThreadPoolExecutor(1, thread_name_prefix="curves")
        future = self._plotter.submit(self.plot)
        future.add_done_callback(lambda f: f.exception() and warnings.warn(f"curves.png not drawn: {f.exception()!r}"))
        return future

    def plot(self, path: str | None = None) -> str:
        """Write the main curves from metrics.jsonl to a PNG (written atomically); returns its path.
        Not drawn again while metrics.jsonl and events.jsonl are as they were at its last drawing:
        the end of a run plots what its last save's plot_soon has just drawn (~1.5 s here)."""
        path = path or os.path.join(self.out_dir, "curves.png")
        with self._drawing:
            inputs = self._inputs()
            if self._drawn.get(path) != inputs or not os.path.exists(path):
                self._draw(path)
                self._drawn[path] = inputs
            return path

    def _inputs(self) -> tuple:
        """What a drawing reads, as (size, mtime) of each file: it changes when either is written."""
        def stamp(name):
            try:
                st = os.stat(os.path.join(self.out_dir, name))
            except FileNotFoundError:
                return None
            return st.st_size, st.st_mtime_ns
        return stamp("metrics.jsonl"), stamp("events.jsonl")

    def _draw(self, path: str) -> str:
        from matplotlib.figure import Figure  # no pyplot: its global state is not for a second thread
        rows = self.history()
        events = os.path.join(self.out_dir, "events.jsonl")
        events = [json.loads(line) for line in open(events)] if os.path.exists(events) else []
        fig = Figure(figsize=(4 * len(PLOT_PANELS), 3.2))
        axes = fig.subplots(1, len(PLOT_PANELS))
        for ax, (title, keys) in zip(axes, PLOT_PANELS.items()):
            for key in keys:
                points = [(r["step"], r[key]) for r in rows if key in r]
                if points:
                    ax.plot(*zip(*points), marker=".", label=key)
            labelled = set()
            for e in events:  # during the step after the last one logged before it
                kind = e["event"]
                ax.axvline(e["step"] + 0.5, color=EVENT_COLORS.get(kind, "gray"), linestyle="--", linewidth=0.8,
                           label=None if kind in labelled else kind)
                labelled.add(kind)
            ax.set_title(title)
            ax.set_xlabel("step")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.tight_layout()
        tmp = path + ".tmp.png"
        fig.savefig(tmp, dpi=90)
        os.replace(tmp, path)
        return path

    def close(self) -> None:
        if self._plotter is not None:
            self._plotter.shutdown(wait=True)
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


EVENT_COLORS = {"restart": "red", "engine_restart": "darkorange"}  # curves.png's marker of each event


def write_event(out_dir: str, event: str, **fields) -> None:
    """One line of `<run dir>/events.jsonl`: what happened to the run besides its steps (a role
    died and the run restarted), with its wall-clock time; curves.png marks them."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "events.jsonl"), "a") as f:
        f.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")


class PhaseLog:
    """`phases.jsonl` in the run folder: one line per phase of the loop, in the order they ran
    ({"step", "phase", "what", "s", "end": its wall-clock end, time.time()}): which role held the
    devices when, e.g. that the engines slept before the actor loaded its state (driver/colocate.py),
    and what each process did meanwhile (bench/core_use.py)."""

    def __init__(self, out_dir: str):
        os.makedirs(out_dir, exist_ok=True)
        self._file = open(os.path.join(out_dir, "phases.jsonl"), "a")

    def write(self, step: int, phase: str, what, seconds: float) -> None:
        self._file.write(json.dumps({"step": step, "phase": phase, "what": list(what), "s": round(seconds, 4),
                                     "end": round(time.time(), 3)}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def staleness(versions: list[tuple[int, int]], syncs: int, bound: int, share: float | None = None) -> dict:
    """Per response, the pushes its oldest token lags the weights it trains (the engine records
    each token's policy version); a response sampled across a push is partial, one that lags at
    all is stale. A lag past `bound`, or a stale share past `share` (trainer.stale_share), cannot
    happen by construction (a batch is asked `bound` steps ahead at most; the rollout manager
    starts no stale group past the share): it is a bug in the version record or the collection,
    and training on it would break the staleness contract."""
    lags = [syncs - oldest for oldest, _ in versions]
    if max(lags) > bound or min(lags) < 0:
        raise RuntimeError(f"a response's policy lag {max(lags)} (oldest version {min(v for v, _ in versions)}, "
                           f"{syncs} weight pushes done) is outside [0, trainer.batches_ahead={bound}]")
    stale = sum(lag > 0 for lag in lags) / len(lags)
    if share is not None and stale > share + 1e-9:
        raise RuntimeError(f"{stale:.3f} of the batch's responses started before its last push: past "
                           f"trainer.stale_share={share}")
    return {"rollout/staleness_mean": sum(lags) / len(lags), "rollout/staleness_max": float(max(lags)),
            "rollout/partial_frac": sum(a != b for a, b in versions) / len(versions), "rollout/stale_share": stale}


def join_parts(parts: list[dict], tokens: Sequence[int] = ()) -> dict:
    """The metrics of a step's streamed parts (trainer.stream_minibatches) as one update's: means
    over its optimizer steps (an update averages its mini-batches the same way), the data plane's
    bytes summed, maxima by max, the last learning rate, perf/actor_tokens_per_s over the whole time
    (`tokens`: each part's)."""
    if len(parts) <= 1:
        return dict(parts[0]) if parts else {}
    out = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        values = [p[key] for p in parts if key in p]
        if key.startswith("data_plane/"):
            out[key] = sum(values)
        elif key.endswith("_max"):
            out[key] = max(values)
        elif key == "actor/lr":
            out[key] = values[-1]
        elif key == "perf/actor_tokens_per_s" and len(tokens) == len(values):
            out[key] = sum(tokens) / sum(n / max(v, 1e-12) for n, v in zip(tokens, values))
        else:
            out[key] = sum(values) / len(values)
    return out


def batch_metrics(step, metrics: dict, resident_bytes: int) -> dict:
    """The kept batch's reward, length and advantage, from its metadata; the bytes the control
    plane (the rollout manager) received from the engines per scored response (`driver/*`: the
    names runs have always logged); what the data plane still holds once the step's partition
    is cleared (its baseline: 0)."""
    tokens = torch.tensor(step.loss_tokens, dtype=torch.float32)
    adv = torch.tensor(step.advantages).abs()
    received = metrics["driver/bytes"]
    return {"reward/kept_mean": sum(step.scores) / len(step), "acc/kept_mean": sum(step.acc) / len(step),
            "response_length/mean": sum(step.response_lengths) / len(step),
            "advantages/abs_mean": float((adv * tokens).sum() / tokens.sum().clamp(min=1)),
            "driver/bytes": received,
            "driver/bytes_per_response": received / max(metrics.get("sampling/scored_responses", 1.0), 1.0),
            "data_plane/resident_mb": resident_bytes / 2**20}
