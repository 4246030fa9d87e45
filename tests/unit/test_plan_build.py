"""The real 30B shapes built rank by rank on the meta device (plan/build.py): every distinct
actor rank's parameters, grad buffers and optimizer state, as Megatron-Core allocates them,
equal the plan's state terms byte for byte; every tensor of the shipped checkpoint list is read
once by the loader and every engine is sent each once (plan/coverage.py). Each build runs in a
process of its own: the CPU backend's patches and torch's fake process group stay out of the
test process."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.background, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROW = re.compile(r"^rank +(\d+) \(pp (\d+) tp (\d+) ep (\d+) etp (\d+) dp \d+ edp \d+\): .*: (equal|DIFFERENT)")


def _listed(config: str) -> tuple[int, int]:
    """The shipped list's tensor count, and what an engine loads: a fused expert tensor of the VL
    checkpoint ([experts, ...], gate and up together) as one tensor per expert and projection."""
    name = "Qwen3-VL-30B-A3B-Instruct" if "_vl_" in config else "Qwen3-30B-A3B-Base"
    with open(os.path.join(ROOT, "configs", "hf", f"{name}.tensors.json")) as f:
        tensors = json.load(f)["tensors"]
    fused = {n: s for n, s in tensors.items() if ".experts." in n and len(s) == 3}
    return len(tensors), len(tensors) + sum(s[0] * (2 if "gate_up" in n else 1) - 1 for n, s in fused.items())


def _build(*args: str) -> tuple[int, str, list[tuple]]:
    proc = subprocess.run([sys.executable, "-m", "dapo_megatron.plan", *args, "--build"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    rows = [m.groups() for m in map(ROW.match, proc.stdout.splitlines()) if m]
    return proc.returncode, proc.stdout + proc.stderr[-3000:], rows


# (config, overrides, distinct (pp, tp, ep, etp) ranks: pp x tp x ep / what EP shares with TP)
LAYOUTS = [
    ("qwen3_30b_a3b_megatron_npu", [], 16),  # TP4 PP2 EP8: both stages, embedding and head apart
    ("qwen3_30b_a3b_megatron_gpu", [], 8),  # TP2 EP8 over 16: a TP rank's EP rank follows from it
    ("qwen3_vl_30b_a3b_megatron_npu", [], 16),  # the vision tower on stage 0
    ("qwen3_vl_30b_a3b_megatron_gpu", [], 8),
    # PP > 1 and expert-TP > 1
    ("qwen3_30b_a3b_megatron_gpu", ["actor.parallel.pp=2", "actor.parallel.ep=4", "actor.parallel.etp=2"], 16),
]


@pytest.mark.parametrize("config,overrides,distinct", LAYOUTS, ids=[f"{c}{'+' if o else ''}" for c, o, _ in LAYOUTS])
def test_every_distinct_rank_built_equals_the_plan(config, overrides, distinct):
    rc, out, rows = _build("--config-name", config, *overrides)
    assert rc == 0 and "every one equal to the plan" in out, out[-3000:]
    assert len(rows) == distinct and all(r[-1] == "equal" for r in rows), out[-3000:]
    coords = {r[1:5] for r in rows}
    assert len(coords) == distinct  # one build per (pp, tp, ep, etp), no data-parallel copy twice
    pp = int(next(w.split("=")[1] for w in overrides if "pp=" in w)) if any("pp=" in w for w in overrides) \
        else (2 if "npu" in config else 1)
    assert {r[1] for r in rows} == {str(s) for s in range(pp)}  # every pipeline stage
    listed, engine = _listed(config)
    assert "error:" not in out
    assert f"checkpoint: {listed:,} tensors of " in out, out[-3000:]
    assert re.search(rf"senders give each of \d+ engines {engine:,} tensors, [\d.]+ GiB per sync, in \d+ buckets",
                     out), out[-3000:]


MUTATED = r"""
import sys
from dapo_megatron.config import load_config
from dapo_megatron.models.registry import get_arch
from dapo_megatron.plan.__main__ import model_spec
from dapo_megatron.plan.build import build_ranks
from dapo_megatron.plan.coverage import Coverage, MetaCheckpoint, tensor_list
from dapo_megatron.weights import name_map as nm
cfg = load_config("qwen3_30b_a3b_megatron_npu", [])
spec = model_spec(cfg)
if sys.argv[1] == "expert row":  # the name table loses the experts' gate rows (of the fused gate / up)
    arch = get_arch(spec.model_type)
    object.__setattr__(arch, "names", {k: v for k, v in arch.names.items() if not (".experts." in k and "gate_proj" in k)})
else:  # the attention's q / k / v rows counted whole on every TP rank
    nm.TP_DIM["decoder.layers.{}.self_attention.linear_qkv.weight"] = None
cov = Coverage(MetaCheckpoint(tensor_list(cfg.model.path)), spec, 1 << 30)
(b,) = build_ranks(cfg, spec, ranks=[0], coverage=cov)
print("\n".join(cov.errors))
print("equal" if b.equal else f"DIFFERENT {b.built} {b.planned}")
"""


@pytest.mark.parametrize("mutation,load_error", [
    ("expert row", "unexpected tensor model.layers.0.mlp.experts.0.gate_proj.weight"),
    ("kv split", "model.layers.0.self_attn.q_proj.weight"),
])
def test_a_wrong_table_differs_from_the_build(mutation, load_error):
    """The check can fail: the plan from a table missing one expert row, or splitting the
    attention rows wrongly over TP, is not what Megatron builds, and the loader reading the
    shipped list into the built rank names the tensor it cannot place."""
    proc = subprocess.run([sys.executable, "-c", MUTATED, mutation], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("DIFFERENT"), proc.stdout[-2000:]
    assert any(line.startswith("rank 0: load: ") and load_error in line for line in lines), proc.stdout[-2000:]
