"""Build the offline tiny assets (tokenizer, warmed-up tiny models, task data) and resolve tiny://.

Layout of an asset dir:
    tokenizer/            HF fast tokenizer (byte-level BPE, ChatML template)
    qwen2/, qwen3_moe/    HF checkpoints, tokenizer files copied in (each dir is self-contained)
    data/train.parquet, data/val.parquet    the addition task in the verl schema
    manifest.json         what was built, with which seed and versions, and the measured accuracy
The tool task's bundle (assets/tools.py: tokenizer/, qwen2/, data/, manifest.json) is built on the
first use of a tiny://tools/... path into a sibling dir, `<asset dir>-tools`, and the vision-language
bundle (assets/vl.py: qwen3_vl_moe/, geo3k/, manifest.json) on the first use of tiny://qwen3_vl_moe
or tiny://geo3k/... into `<asset dir>-vl`, so no build ever replaces another.

A build goes into a temp dir next to the target and is renamed into place at the end, under a
file lock, so concurrent first uses (several Ray workers resolving tiny:// at once) build once
and nobody ever sees a half-written dir. It runs in a process started with pinned CPU kernels
(assets/kernels.py), so a recipe builds the same bytes on every x86-64 machine; the manifest
records each file's sha256, a default build is checked against the recipe's (RECORDED_SHA256),
and tiny:// checks a bundle against its manifest before it hands a path out.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import tokenizers
import torch
import transformers

from dapo_megatron.assets import kernels, tools
from dapo_megatron.assets.models import build_tiny_model
from dapo_megatron.assets.tokenizer import build_tokenizer, special_token_ids
from dapo_megatron.assets.warmup import sampled_accuracy, supervised_warmup
from dapo_megatron.data import synthetic
from dapo_megatron.data.dataset import DataError

ASSET_VERSION = "tiny-v2"  # bump when the layout or recipe changes; it names the cache dir
TINY_SCHEME = "tiny://"
ASSETS_ENV = "DAPO_MEGATRON_ASSETS"
DEFAULT_SEED = 0
# The warm-up stops once sampled accuracy (T=1, train pairs) reaches TARGET_ACCURACY, checked
# every 10 steps, or after `warmup_steps`. A fixed step count was too seed-dependent: at 120
# steps (batch 64, lr 1e-3) seeds gave 0.08-0.36. Around 0.3 the format is learnt and most sums
# are not yet, so DAPO has both signal (mixed groups) and headroom.
DEFAULT_WARMUP_STEPS = 400
TARGET_ACCURACY = 0.25
WARMUP = dict(batch_size=64, lr=1e-3)
EVAL = dict(samples_per_pair=8, temperature=1.0, max_new_tokens=16)
STOP_CHECK = dict(samples_per_pair=4, temperature=1.0, max_new_tokens=16)  # cheaper, every 10 steps
MODEL_KINDS = ("qwen2", "qwen3_moe")
MANIFEST = kernels.MANIFEST
TOOLS_DIR = "tools"  # tiny://tools/...: the tool task's bundle (tool_asset_dir())
VL_NAMES = ("qwen3_vl_moe", "geo3k")  # tiny://qwen3_vl_moe, tiny://geo3k/...: the VL bundle (vl_asset_dir())
TEXT_NAMES = ("tokenizer", "data", *MODEL_KINDS)  # the addition bundle's top-level dirs (default_asset_dir())
# sha256 over each bundle's files (manifest.json aside, kernels.bundle_sha256) as its default
# recipe builds them with the pinned kernels, under torch 2.13.0 and transformers 5.19.0: a default
# build that differs says so in one line (other library versions, or a CPU below x86-64-v2).
RECORDED_SHA256 = {
    "text": "48f7e077d28874dd5441ce284e2f3d36b56a0439621c7cbbba878bc89d96bec9",
    "tools": "cf5982c878ab628a8186191e7ad0e5103361edfa4725ecaad54e6846679f6c63",
    "vl": "f952af956c42b0aa6182bf6c1123356140f2a31bb3ccdf719a408b44f7559c49",
}


class AssetError(DataError):
    """A tiny bundle that is not what its manifest recorded (a file changed or went missing)."""


def default_asset_dir() -> Path:
    """$DAPO_MEGATRON_ASSETS, else ~/.cache/dapo-megatron/tiny-v2."""
    env = os.environ.get(ASSETS_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dapo-megatron" / ASSET_VERSION


def tool_asset_dir() -> Path:
    """Where tiny://tools/... lives: beside the addition bundle."""
    root = default_asset_dir()
    return root.with_name(root.name + "-" + TOOLS_DIR)


def vl_asset_dir() -> Path:
    """Where tiny://qwen3_vl_moe and tiny://geo3k/... live: beside the addition bundle."""
    root = default_asset_dir()
    return root.with_name(root.name + "-vl")


def read_manifest(asset_dir: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(asset_dir) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def build_assets(out_dir: str | os.PathLike, *, seed: int = DEFAULT_SEED, warmup_steps: int = DEFAULT_WARMUP_STEPS,
                 force: bool = False, log: Callable[[str], None] = print, kernels: str = "pinned") -> Path:
    """Build the addition bundle (tokenizer, models, data) into `out_dir` (atomically); a dir with
    a matching manifest is kept, one built with other settings is an error unless `force`.
    kernels: "pinned" (a process of its own, unless this one has the pins) or "native" (here, on
    whatever kernels this process has: the bytes depend on the machine)."""
    # The manifest entries that must match for an existing dir to count as the requested build.
    want = {"asset_version": ASSET_VERSION, "seed": seed, "warmup_steps": warmup_steps,
            "target_accuracy": TARGET_ACCURACY, "kernels": kernels}
    again = dict(out_dir=str(out_dir), seed=seed, warmup_steps=warmup_steps, force=force)
    return _atomic_build(Path(out_dir), want, lambda tmp: _build_into(tmp, seed=seed, warmup_steps=warmup_steps,
                                                                       log=log), force=force, log=log,
                         bundle="text", again=("build_assets", again),
                         default=seed == DEFAULT_SEED and warmup_steps == DEFAULT_WARMUP_STEPS)


def build_tool_assets(out_dir: str | os.PathLike, *, seed: int = DEFAULT_SEED, warmup_steps: int | None = None,
                      force: bool = False, log: Callable[[str], None] = print, accuracy: bool = True,
                      kernels: str = "pinned") -> Path:
    """The tool task's bundle (assets/tools.py) into `out_dir`, atomically, like `build_assets`
    (`accuracy=False`: without the manifest's accuracy figures; warmup_steps: at most this many
    warm-up steps, default tools.WARMUP_STEPS)."""
    steps = tools.WARMUP_STEPS if warmup_steps is None else warmup_steps
    want = {"asset_version": tools.TOOLS_VERSION, "seed": seed, "warmup_steps": steps,
            "target_accuracy": tools.TARGET_ACCURACY, "kernels": kernels}
    again = dict(out_dir=str(out_dir), seed=seed, warmup_steps=steps, force=force, accuracy=accuracy)

    def build(tmp: Path) -> dict[str, Any]:
        with _quiet_progress_bars():
            return tools.build_tool_bundle(tmp, seed=seed, warmup_steps=steps, log=log, accuracy=accuracy)
    return _atomic_build(Path(out_dir), want, build, force=force, log=log, bundle="tools",
                         again=("build_tool_assets", again),
                         default=seed == DEFAULT_SEED and steps == tools.WARMUP_STEPS)


def build_vl_task_assets(out_dir: str | os.PathLike, *, seed: int = DEFAULT_SEED, warmup_steps: int | None = None,
                         force: bool = False, log: Callable[[str], None] = print, kernels: str = "pinned") -> Path:
    """The VL bundle (assets/vl.py) into `out_dir`, atomically, like `build_assets`.
    warmup_steps: the warm-up's steps (default vl.WARMUP_STEPS; 0: the random-init model)."""
    from dapo_megatron.assets import vl
    steps = vl.WARMUP_STEPS if warmup_steps is None else warmup_steps
    want = {"asset_version": vl.VL_VERSION, "seed": seed, "warmup_steps": steps, "kernels": kernels}
    again = dict(out_dir=str(out_dir), seed=seed, warmup_steps=steps, force=force)

    def build(tmp: Path) -> dict[str, Any]:
        with _quiet_progress_bars():
            return vl.build_vl_bundle(tmp, seed=seed, warmup_steps=steps, log=log)
    return _atomic_build(Path(out_dir), want, build, force=force, log=log, bundle="vl",
                         again=("build_vl_task_assets", again),
                         default=seed == DEFAULT_SEED and steps == vl.WARMUP_STEPS)


def _atomic_build(out: Path, want: dict[str, Any], build: Callable[[Path], dict[str, Any]], *, force: bool,
                  log: Callable[[str], None], bundle: str, again: tuple[str, dict], default: bool) -> Path:
    """Build into a temp dir beside `out` under a file lock and rename it into place; a dir whose
    manifest matches `want` is kept. A dir built with other settings is an error unless `force`:
    silently replacing assets that another run may be training from would be worse than asking.
    A pinned build from a process without the pins runs `again` (builder, arguments) in a process
    started with them. default: the recipe's own seed and steps (RECORDED_SHA256 applies)."""
    if want["kernels"] not in kernels.KERNELS:
        raise ValueError(f"kernels={want['kernels']!r}: one of {', '.join(kernels.KERNELS)}")
    out = out.expanduser().resolve()
    if want["kernels"] == "pinned" and not kernels.pinned_here():
        if _kept(out, want, force, log):
            return out
        return _build_pinned(*again, log=log)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(out.parent / f".{out.name}.lock"):
        if _kept(out, want, force, log):
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            manifest = build(tmp)
            # what torch's kernels ran at (the pins took: DEFAULT), and the bytes they gave
            manifest.update(kernels=want["kernels"], cpu_capability=torch.backends.cpu.get_cpu_capability(),
                            checksum=kernels.checksum(tmp))
            if want["kernels"] == "pinned":
                manifest["kernel_settings"] = kernels.PINNED
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            _replace_dir(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"built tiny assets in {out} in {manifest['build_seconds']:.1f} s")
    recorded, built = RECORDED_SHA256[bundle], manifest["checksum"]["sha256"]
    if default and want["kernels"] == "pinned" and built != recorded:
        print(f"warning: the {bundle} bundle built in {out} is sha256 {built[:12]}..., its recipe recorded "
              f"{recorded[:12]}... (this build: torch {torch.__version__}, transformers {transformers.__version__}; "
              "other versions or a CPU below x86-64-v2 build other bytes): the docs' figures may differ",
              file=sys.stderr, flush=True)
    return out


def _kept(out: Path, want: dict[str, Any], force: bool, log: Callable[[str], None]) -> bool:
    """Whether `out` already holds the build `want` describes (then it is kept); an error if it
    holds another one and `force` is not set."""
    have = {k: (read_manifest(out) or {}).get(k) for k in want}
    if have == want and not force:
        log(f"tiny assets in {out} are up to date ({want}); nothing to do")
        return True
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists but was not built with {want} (its manifest: {have}); "
                              f"pass --force to rebuild it")
    return False


def _build_pinned(builder: str, kwargs: dict, *, log: Callable[[str], None]) -> Path:
    """`builder(**kwargs)` of this module in a process started with the pinned kernels."""
    return Path(kernels.call_pinned(f"{__name__}:{builder}", kwargs, log=log))


def resolve_asset_path(path: str) -> str:
    """`tiny://NAME` -> a path under default_asset_dir(), building the assets on first use.

    Examples: tiny://qwen3_moe, tiny://tokenizer, tiny://data/train.parquet; tiny://tools/... and
    tiny://qwen3_vl_moe, tiny://geo3k/{train,val}.parquet live in their own bundles, built on their
    own first use. Any other path is returned unchanged, so callers can pass every configured path
    through this function.
    """
    if not path.startswith(TINY_SCHEME):
        return path
    name = path[len(TINY_SCHEME):]
    root = default_asset_dir()
    if name.split("/")[0] == TOOLS_DIR:  # the tool task's bundle, built apart on its own first use
        root, name, bundle, version = tool_asset_dir(), name[len(TOOLS_DIR) + 1:], "tools", tools.TOOLS_VERSION
        build = lambda: build_tool_assets(root, log=lambda _msg: None)  # noqa: E731
    elif name.split("/")[0] in VL_NAMES:  # the VL bundle: its names are its own dirs
        from dapo_megatron.assets.vl import VL_VERSION as version
        root, bundle = vl_asset_dir(), "vl"
        build = lambda: build_vl_task_assets(root, log=lambda _msg: None)  # noqa: E731
    else:
        version, bundle = ASSET_VERSION, "text"
        build = lambda: build_assets(root, log=lambda _msg: None)  # noqa: E731
        if name.split("/")[0] not in TEXT_NAMES:  # a typo is an error now, not after a first build's minutes
            raise FileNotFoundError(f"{path}: no tiny asset of that name (tiny:// names: "
                                    f"{', '.join((*TEXT_NAMES, *VL_NAMES, TOOLS_DIR + '/...'))})")
    manifest = read_manifest(root)
    if manifest is not None and manifest.get("asset_version") != version:
        # kept, not rebuilt: another run may be training from it (rebuilding is asked for, --force)
        warnings.warn(f"the tiny assets in {root} are {manifest.get('asset_version')}, this checkout's recipe is "
                      f"{version}: rebuild them with `python -m dapo_megatron.assets build --bundle {bundle} "
                      f"--out {root} --force` for the figures the docs give", stacklevel=2)
    if manifest is None:
        print(f"dapo-megatron: {path} is used for the first time: building the tiny assets in {root} (2-5 "
              f"minutes on 2 CPU cores, once; set ${ASSETS_ENV} to put them elsewhere)", file=sys.stderr, flush=True)
        start = time.perf_counter()
        build()
        print(f"dapo-megatron: built the tiny assets in {time.perf_counter() - start:.0f} s", file=sys.stderr,
              flush=True)
    target = root / name
    if not target.exists():
        names = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
        raise FileNotFoundError(f"{path}: no {target.name!r} in the tiny assets at {root} (have: {names})")
    _check_bundle(root, bundle)
    return str(target)


_CHECKED: set[tuple[str, float]] = set()  # (bundle dir, its manifest's mtime): read once per process


def _check_bundle(root: Path, bundle: str) -> None:
    """The bundle's files are what its manifest recorded (a manifest without checksums: not
    checked); one line naming the file, and how to build the bundle again, if not."""
    key = (str(root), (root / MANIFEST).stat().st_mtime)
    if key in _CHECKED:
        return
    recorded = ((read_manifest(root) or {}).get("checksum") or {}).get("files")
    problem = kernels.changed_file(root, recorded) if recorded else None
    if problem:
        raise AssetError(f"{problem}; build the bundle again with `python -m dapo_megatron.assets build --bundle "
                         f"{bundle} --out {root} --force`")
    _CHECKED.add(key)


def _build_into(root: Path, *, seed: int, warmup_steps: int, log: Callable[[str], None]) -> dict[str, Any]:
    start = time.perf_counter()
    tokenizer = build_tokenizer(str(root / "tokenizer"))
    train_rows, val_rows = synthetic.make_splits(seed)
    (root / "data").mkdir()
    for name, rows in (("train", train_rows), ("val", val_rows)):
        pq.write_table(pa.Table.from_pylist(rows), root / "data" / f"{name}.parquet")
    models = {}
    for kind in MODEL_KINDS:
        models[kind] = _build_model(kind, root / kind, root / "tokenizer", tokenizer, seed=seed,
                                    warmup_steps=warmup_steps)
        log(f"{kind}: {_describe(models[kind])}")
    manifest = {
        "asset_version": ASSET_VERSION, "seed": seed, "warmup_steps": warmup_steps,
        "target_accuracy": TARGET_ACCURACY, "warmup": WARMUP, "eval": EVAL, "models": models,
        "tokenizer": {"vocab_size": len(tokenizer), **special_token_ids(tokenizer)},
        "data": {"data_source": synthetic.DATA_SOURCE, "train_rows": len(train_rows), "val_rows": len(val_rows),
                 "val_pairs_held_out": True},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "pyarrow": pa.__version__,
                     "python": sys.version.split()[0]},
        "build_seconds": round(time.perf_counter() - start, 2),
    }
    return manifest  # written by build._atomic_build, with the kernels and the checksum


def _build_model(kind: str, model_dir: Path, tokenizer_dir: Path, tokenizer, *, seed: int,
                 warmup_steps: int) -> dict[str, Any]:
    """Random-init `kind`, warm it up on the train pairs, save it with the tokenizer files."""
    from transformers import AutoModelForCausalLM
    ids = special_token_ids(tokenizer)
    with _quiet_progress_bars():
        build_tiny_model(kind, str(model_dir), vocab_size=len(tokenizer), seed=seed, special_token_ids=ids)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    stats: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters())}
    if warmup_steps > 0:
        stats.update(_warm_up(model, tokenizer, seed=seed, max_steps=warmup_steps))
        with _quiet_progress_bars():
            model.save_pretrained(str(model_dir), safe_serialization=True)
    tools.finish_model_dir(model_dir, tokenizer_dir, ids)
    return stats


def _warm_up(model, tokenizer, *, seed: int, max_steps: int) -> dict[str, Any]:
    """Supervised warm-up until TARGET_ACCURACY or max_steps; returns the numbers for the manifest."""
    train_pairs, val_pairs = synthetic.split_pairs(seed)

    def reached() -> bool:
        return sampled_accuracy(model, tokenizer, train_pairs, seed=seed, **STOP_CHECK) >= TARGET_ACCURACY

    # One thread: CPU kernels reduce in a thread-count-dependent order and the same seed must give
    # the same bytes on any machine. More threads do not help at this size, and on a busy 2-core
    # machine they made training steps ~50x slower (spinning OpenMP workers).
    with _torch_threads(1):
        before = sampled_accuracy(model, tokenizer, train_pairs, seed=seed, **EVAL)
        begin = time.perf_counter()
        losses = supervised_warmup(model, tokenizer, train_pairs, steps=max_steps, seed=seed, stop=reached, **WARMUP)
        seconds = time.perf_counter() - begin
        return {"warmup_steps_taken": len(losses), "warmup_seconds": round(seconds, 2),
                "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
                "train_accuracy_before": before,
                "train_accuracy": sampled_accuracy(model, tokenizer, train_pairs, seed=seed, **EVAL),
                "val_accuracy": sampled_accuracy(model, tokenizer, val_pairs, seed=seed, **EVAL)}


def _describe(stats: dict[str, Any]) -> str:
    if "warmup_seconds" not in stats:
        return f"{stats['params']:,} params, no warm-up"
    return (f"{stats['params']:,} params, warm-up {stats['warmup_steps_taken']} steps in "
            f"{stats['warmup_seconds']:.1f} s, loss {stats['loss_first']:.3f} -> {stats['loss_last']:.3f}, "
            f"sampled accuracy (T=1) {stats['train_accuracy_before']:.3f} -> {stats['train_accuracy']:.3f} train, "
            f"{stats['val_accuracy']:.3f} val")


def _replace_dir(new: Path, out: Path) -> None:
    """Rename `new` to `out`; an old `out` is moved aside first and deleted after the swap."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    os.rename(new, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def _file_lock(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def _torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _quiet_progress_bars():
    """transformers draws a bar per save/load; in a build of two tiny models they are just noise."""
    from transformers.utils import logging as hf_logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
