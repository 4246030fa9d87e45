"""`python -m dapo_megatron.assets compare`: the same bytes from a smaller CPU, shown on one machine.

Each bundle is built four times, each in a process of its own: with the pinned kernels and
without (`native`), on this machine as it is and told it is a smaller one (kernels.SMALLER_CPU:
torch's portable kernels, oneDNN at SSE4.1, MKL at SSE4.2, glibc without AVX / FMA). The pinned
pair must be the same files; the native pair shows where an unpinned build follows the CPU. At
the recipe's own warm-up length the pinned build is also checked against RECORDED_SHA256.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from dapo_megatron.assets import kernels
from dapo_megatron.assets.build import RECORDED_SHA256

BUNDLES = ("text", "tools", "vl")
SETTINGS = {  # name -> (kernels, environment over this machine's)
    "pinned": ("pinned", {}),
    "pinned, smaller CPU": ("pinned", kernels.SMALLER_CPU),
    "native": ("native", {}),
    "native, smaller CPU": ("native", kernels.SMALLER_CPU),
}


def build_once(bundle: str, out: Path, setting: str, *, seed: int, warmup_steps: Optional[int]) -> dict:
    """One build in a process started with `setting`'s environment; returns its manifest."""
    mode, over = SETTINGS[setting]
    env = {k: v for k, v in os.environ.items() if k not in kernels.PINNED and k not in kernels.SMALLER_CPU}
    env.update(over)
    if mode == "pinned":
        env = kernels.pinned_env(env)  # the build then runs in this process, as the pins' child does
    cmd = [sys.executable, "-m", "dapo_megatron.assets", "build", "--bundle", bundle, "--out", str(out),
           "--seed", str(seed), "--kernels", mode, "--force"]
    if warmup_steps is not None:
        cmd += ["--warmup-steps", str(warmup_steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{bundle} ({setting}): the build failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}")
    return json.loads((out / kernels.MANIFEST).read_text())


def differing(a: dict, b: dict) -> list[str]:
    """The files two manifests' checksums disagree on (one side's only files included)."""
    fa, fb = a["checksum"]["files"], b["checksum"]["files"]
    return sorted(name for name in fa.keys() | fb.keys() if fa.get(name) != fb.get(name))


def pair_text(files: list[str]) -> str:
    """What a pair of builds differs in, in words."""
    if not files:
        return "the same files"
    return f"{len(files)} file{'s differ' if len(files) > 1 else ' differs'}: {', '.join(files)}"


def compare(bundles=BUNDLES, *, work: Path, seed: int = 0, warmup_steps: Optional[int] = None,
            settings=tuple(SETTINGS), log=print) -> dict:
    """Build each bundle under each setting into `work`; returns, per bundle, each setting's
    sha256 and seconds and the files each pair (pinned, native) differs in."""
    results = {}
    for bundle in bundles:
        built, row = {}, {"settings": {}}
        for setting in settings:
            start = time.perf_counter()
            built[setting] = build_once(bundle, work / f"{bundle}-{setting.replace(', ', '-').replace(' ', '-')}",
                                        setting, seed=seed, warmup_steps=warmup_steps)
            row["settings"][setting] = {"sha256": built[setting]["checksum"]["sha256"],
                                        "seconds": round(time.perf_counter() - start, 1)}
            log(f"{bundle:5s}  {setting:20s}  sha256 {row['settings'][setting]['sha256'][:16]}  "
                f"{row['settings'][setting]['seconds']:6.1f} s")
        for mode in ("pinned", "native"):
            pair = [s for s in settings if SETTINGS[s][0] == mode]
            if len(pair) == 2:
                row[f"{mode}_differs_in"] = differing(built[pair[0]], built[pair[1]])
        if "pinned" in built and warmup_steps is None and seed == 0:
            row["recorded_sha256"] = RECORDED_SHA256[bundle]
            row["pinned_is_recorded"] = built["pinned"]["checksum"]["sha256"] == RECORDED_SHA256[bundle]
        results[bundle] = row
    return results


def main(args) -> int:
    """The command: a table on stdout, the results as JSON (--json), exit 1 if a pinned pair differs
    or a default build is not the recorded one."""
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="dapo-assets-compare-"))
    results = compare(args.bundles, work=work, seed=args.seed, warmup_steps=args.warmup_steps)
    failed = False
    for bundle, row in results.items():
        for mode in ("pinned", "native"):
            files = row.get(f"{mode}_differs_in")
            if files is not None:
                print(f"{bundle}: {mode} builds on this CPU and on a smaller one: {pair_text(files)}")
        failed |= bool(row.get("pinned_differs_in")) or row.get("pinned_is_recorded") is False
        if "pinned_is_recorded" in row:
            print(f"{bundle}: the pinned build {'is' if row['pinned_is_recorded'] else 'is NOT'} the recipe's "
                  f"recorded sha256 {row['recorded_sha256'][:16]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"warmup_steps": args.warmup_steps, "seed": args.seed,
                                               "bundles": results}, indent=2) + "\n")
    print(f"builds in {work}")
    return 1 if failed else 0
