"""Two runs compared for trainer.deterministic (tests/e2e/test_driver.py, test_async.py): their
metrics but the clocks, and their checkpoints by content."""
from __future__ import annotations

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
    """The names whose contents differ between the two runs' checkpoints of `step` (both must
    hold the same names, and a dist checkpoint's state)."""
    ours, theirs = (checkpoint_contents(run / "checkpoints" / step, tmp / f"{i}-{step}")
                    for i, run in enumerate((one, other)))
    assert sorted(ours) == sorted(theirs) and sum(k.startswith("state/") for k in ours) > 20, sorted(ours)
    return [k for k in ours if not same(ours[k], theirs[k])]
