"""Are two runs the same run? Their metrics but the clocks, step by step, and their checkpoints by
content: what trainer.deterministic promises (docs/reproducibility.md).

    python -m dapo_megatron.tools.same_run RUN_DIR OTHER_RUN_DIR [--steps step_2,step_4]

Prints the first step whose metrics differ (with the keys and both values), then, for each
checkpoint both runs saved (or `--steps`), the names whose contents differ. Exit code 0 when
everything compared is equal, 1 when something differs, 2 on bad input (a missing run file).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

# What a run measures of the machine, not of the training: the clocks (timing/*, perf/* and the CPU
# seconds), memory/* and the data plane's resident bytes as a step's rows go (with a batch asked
# ahead, how much of it its collection has written by then is the clock's: seen to differ once in
# seven runs of the one_step_off pair); and what a killed run counts of its faults (its restarts).
CLOCKS = ("timing/", "perf/", "memory/")
UNTIMED = ("data_plane/resident_mb", "rollout/engine_restarts")


def stable(rows: list[dict]) -> list[dict]:
    """Each metrics row without what two equal runs may differ in (CLOCKS, UNTIMED, *cpu_s)."""
    return [{k: v for k, v in r.items() if not k.startswith(CLOCKS) and k not in UNTIMED
             and not k.endswith("cpu_s")} for r in rows]


def read_rows(run: Path) -> list[dict]:
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (a run directory holds metrics.jsonl: trainer.logger=[jsonl])")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            raise ValueError(f"{path}: line {i} is not a JSON row: {line[:60]!r}") from None
    return rows


def first_difference(rows: list[dict], other: list[dict]) -> str | None:
    """The first step whose stable metrics differ, as one line; None when every step is equal."""
    for a, b in zip(stable(rows), stable(other)):
        keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        if keys:
            shown = ", ".join(f"{k} {a.get(k)} / {b.get(k)}" for k in keys[:4])
            return f"step {a.get('step')}: {len(keys)} metrics differ: {shown}{' ...' if len(keys) > 4 else ''}"
    if len(rows) != len(other):
        return f"the runs logged {len(rows)} and {len(other)} steps (equal as far as both went)"
    return None


def checkpoint_contents(checkpoint: Path, tmp: Path) -> dict:
    """Everything a checkpoint holds, by name: the dist checkpoint's state (model, optimizer,
    schedule, trainer state) read without a process group, each torch file loaded, every other
    file's bytes. Left out: torch's `.metadata`, whose writer puts random IDs in it, and the
    checksums of the files (that one among them)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    tmp.mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(str(checkpoint), str(tmp / "state.pt"))
    out = {f"state/{k}": v for k, v in torch.load(tmp / "state.pt", weights_only=False).items()}
    for path in sorted(checkpoint.rglob("*")):
        name = str(path.relative_to(checkpoint))
        if path.is_dir() or path.suffix == ".distcp" or path.name in (".metadata", "checksums.json"):
            continue
        out[name] = torch.load(path, weights_only=False) if path.suffix == ".pt" else path.read_bytes()
    return out


def same(a, b) -> bool:
    """Equal all the way down: tensors bit for bit (dtype and shape too), containers item by item."""
    import torch
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def differing(one: Path, other: Path, step: str, tmp: Path) -> list[str]:
    """The names whose contents differ between the two runs' checkpoints of `step` (a name only
    one of them holds among them; both must hold a dist checkpoint's state)."""
    ours, theirs = (checkpoint_contents(Path(run) / "checkpoints" / step, Path(tmp) / f"{i}-{step}")
                    for i, run in enumerate((one, other)))
    for run, contents in ((one, ours), (other, theirs)):
        if sum(k.startswith("state/") for k in contents) <= 20:
            raise ValueError(f"{Path(run) / 'checkpoints' / step}: no model state in it (a dist checkpoint "
                             f"holds the model's and optimizer's tensors)")
    return sorted(k for k in ours.keys() | theirs.keys() if k not in ours or k not in theirs or not same(ours[k], theirs[k]))


def saved_steps(run: Path) -> set[str]:
    folder = Path(run) / "checkpoints"
    return {p.name for p in folder.glob("step_*") if p.is_dir()} if folder.is_dir() else set()


def common_steps(one: Path, other: Path) -> list[str]:
    """The checkpoints both runs saved, in step order."""
    return sorted(saved_steps(one) & saved_steps(other), key=lambda s: int(s.split("_")[1]))


def compare(one: Path, other: Path, steps: list[str] | None = None) -> list[str]:
    """What differs between the two runs, a line each (empty: the same run); `steps`: the
    checkpoints compared (default: every one both saved)."""
    lines = [first_difference(read_rows(one), read_rows(other))]
    with tempfile.TemporaryDirectory() as tmp:
        for step in common_steps(one, other) if steps is None else steps:
            names = differing(one, other, step, Path(tmp))
            if names:
                lines.append(f"{step}: {len(names)} checkpoint entries differ: {', '.join(names[:6])}"
                             f"{' ...' if len(names) > 6 else ''}")
    return [line for line in lines if line]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dapo_megatron.tools.same_run", description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path)
    p.add_argument("other", type=Path)
    p.add_argument("--steps", default="", help="checkpoints to compare, comma-separated (default: every one both saved)")
    args = p.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s] or common_steps(args.run, args.other)
    for step in steps:
        for run in (args.run, args.other):
            if step not in saved_steps(run):
                print(f"error: --steps: {run / 'checkpoints' / step} does not exist", file=sys.stderr)
                return 2
    try:
        lines = compare(args.run, args.other, steps)
        logged = len(read_rows(args.run))
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines) if lines else
          f"the same run: {logged} steps of metrics (clocks aside), checkpoints {', '.join(steps) or 'none in common'}")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
