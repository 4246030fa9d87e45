"""Every checkpoint tensor mapped once, and every engine sent each once, at the real shape.

Run on each distinct rank's meta-built model, inside its fake process group (plan/build.py):
- the loader (weights/load.py `load_from`) reads the shipped tensor list of the model
  (configs/hf/<model>.tensors.json: the published index's names, each with its shape) as a
  checkpoint whose reads are meta tensors of the slice's shape: its own shape checks run at the
  real TP / EP / PP split, and every read is recorded;
- the weight sync's export (weights/export.py, experts="owner") runs on the same model and
  records what the rank would send: names, shapes, bytes.
Then, over all ranks: each listed tensor's reads tile it (no row read twice by a split, none left
out), and the senders the sync picks (one per stage for the dense tensors, one per stage and EP
rank for the experts, `weights.sync.sender_roles`) give every engine each HF tensor once, with
the list's shape.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dapo_megatron.weights.export import bucketize, iter_hf_params
from dapo_megatron.weights.hf_io import CheckpointError
from dapo_megatron.weights.load import UnstackedExperts, load_from

SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "hf"


def tensor_list(model_path: str) -> Path | None:
    """The shipped tensor list of a model dir of that name, if there is one."""
    path = SHIPPED / f"{Path(model_path.rstrip('/')).name}.tensors.json"
    return path if path.is_file() else None


class MetaCheckpoint:
    """A tensor list read as a checkpoint (HFCheckpoint's dir, keys, shape, read): reads are
    meta tensors of the slice's shape; each is recorded as (name, dim, start, end)."""

    def __init__(self, path: Path):
        self.dir = str(path)
        self.shapes = {name: tuple(shape) for name, shape in json.loads(path.read_text())["tensors"].items()}
        self.reads: list[tuple[str, int | None, int, int | None]] = []

    def keys(self) -> set[str]:
        return set(self.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.shapes:
            raise CheckpointError(f"tensor {name} is not in {self.dir}")
        return self.shapes[name]

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None):
        shape = list(self.shape(name))
        if dim is not None:
            end = shape[dim] if end is None else end
            shape[dim] = end - start
        self.reads.append((name, dim, start, end))
        return torch.empty(shape, device="meta")


@dataclass
class Coverage:
    """What every rank read and would send, gathered rank by rank (`add`), checked at the end."""
    listed: MetaCheckpoint
    spec: object
    bucket_bytes: int
    reads: dict = field(default_factory=lambda: defaultdict(set))  # name -> {(dim, start, end)}
    senders: Counter = field(default_factory=Counter)  # ("dense", stage) / ("experts", stage, ep) -> ranks
    sent: dict = field(default_factory=dict)  # the same key -> {hf name: shape}
    buckets: dict = field(default_factory=dict)  # the same key -> bucket count per sync
    nbytes: dict = field(default_factory=dict)  # the same key -> bytes per sync
    errors: list = field(default_factory=list)

    def roles(self, coords, dense: bool, experts: bool) -> None:
        """Any rank, built or a data-parallel copy: which senders it is (sync's own roles)."""
        if dense:
            self.senders["dense", coords.pp_rank] += 1
        if experts:
            self.senders["experts", coords.pp_rank, coords.ep_rank] += 1

    def add(self, rank: int, coords, model) -> None:
        """A built rank: load the list into it, export it. Errors are kept, naming the rank."""
        self.listed.reads = []
        try:
            load_from(self.listed, model)
        except (CheckpointError, KeyError, ValueError) as exc:
            self.errors.append(f"rank {rank}: load: {exc.args[0] if isinstance(exc, KeyError) else exc}")
            return
        twice = [r for r, n in Counter(self.listed.reads).items() if n > 1]
        if twice:
            self.errors.append(f"rank {rank}: read {twice[0]} twice: two parameters map to one tensor")
        for name, *where in self.listed.reads:
            self.reads[name].add(tuple(where))
        dense, experts = [], []
        for pm, tensors in iter_hf_params(model, experts="owner"):
            (experts if pm.is_expert else dense).extend(tensors.items())
        for key, items, owner in ((("dense", coords.pp_rank), dense, coords.tp_rank == 0),
                                  (("experts", coords.pp_rank, coords.ep_rank), experts, coords.etp_rank == 0)):
            if owner and items and key not in self.sent:  # the TP / expert-TP rank 0 model is the sender's
                self.sent[key] = {name: tuple(t.shape) for name, t in items}
                self.buckets[key] = sum(1 for _ in bucketize(items, self.bucket_bytes))
                self.nbytes[key] = sum(t.numel() * t.element_size() for _, t in items)

    def check(self) -> list[str]:
        """Errors: the builds', untiled reads, senders not one per key, an engine's names."""
        errors = list(self.errors)
        for name, shape in sorted(self.listed.shapes.items()):
            problem = _tiling(self.reads.get(name, set()), shape)
            if problem:
                errors.append(f"{name} {list(shape)}: {problem}")
        errors += [f"{key} is sent by {n} ranks, not one" for key, n in sorted(self.senders.items()) if n != 1]
        errors += [f"{key} has a sender that sends nothing" for key in sorted(self.senders) if key not in self.sent]
        got = Counter(name for names in self.sent.values() for name in names)
        want = self.engine_shapes()
        errors += [f"engine: {name} sent {got[name]} times" for name in sorted(got) if got[name] != 1]
        errors += [f"engine: {name} is never sent" for name in sorted(set(want) - set(got))]
        shapes = {name: shape for names in self.sent.values() for name, shape in names.items()}
        errors += [f"engine: {name} sent as {list(shapes[name])}, the list has {list(want[name])}"
                   for name in sorted(set(want) & set(shapes)) if shapes[name] != want[name]]
        errors += [f"engine: {name} is sent but not in {self.listed.dir}" for name in sorted(set(shapes) - set(want))]
        return errors

    def engine_shapes(self) -> dict[str, tuple[int, ...]]:
        """What an engine loads: the list's tensors, a fused expert tensor as its per-expert parts."""
        unstacked = UnstackedExperts(self.listed, self.spec)
        out = {name: shape for name, shape in self.listed.shapes.items() if name not in unstacked.fused}
        out.update((name, unstacked.shape(name)) for name in unstacked.parts)
        return out

    def summary(self, engines: int) -> str:
        sent = sum(len(names) for names in self.sent.values())
        nbytes = sum(self.nbytes.values())
        dense = sum(1 for k in self.sent if k[0] == "dense")
        return (f"checkpoint: {len(self.listed.shapes):,} tensors of {Path(self.listed.dir).name}, each read "
                f"by the loader once (TP / EP / PP splits tile it)\n"
                f"export: {dense} dense + {len(self.sent) - dense} expert senders give each of {engines} engines "
                f"{sent:,} tensors, {nbytes / 2**30:.1f} GiB per sync, in {sum(self.buckets.values())} buckets of "
                f"{self.bucket_bytes >> 20} MiB (at most {max(self.buckets.values(), default=0)} from one sender)")


def _tiling(reads: set, shape: tuple[int, ...]) -> str:
    """'' when the reads of one tensor cover it exactly once (replicas read the same range)."""
    if not reads:
        return "no parameter reads it"
    if (None, 0, None) in reads:
        return "" if len(reads) == 1 else f"read whole and in parts {sorted(r for r in reads if r[0] is not None)}"
    dims = {d for d, _, _ in reads}
    if len(dims) > 1:
        return f"split along dims {sorted(dims)}"
    (dim,) = dims
    at = 0
    for _, start, end in sorted(reads, key=lambda r: (r[1], r[2])):
        if start != at:
            return f"rows {at}-{start} of dim {dim} {'read twice' if start < at else 'never read'}"
        at = end
    return "" if at == shape[dim] else f"rows {at}-{shape[dim]} of dim {dim} never read"
