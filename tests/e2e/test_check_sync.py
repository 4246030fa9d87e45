"""Weight sync from sharded actors into a vLLM-CPU engine, checked the way a user would
(`python -m dapo_megatron.tools.check_sync`): the actor takes an optimizer step, syncs through
the driver's path (owner routing, Ray or broadcast transport, checksums), and the engine's log-probs of sampled
tokens must equal HF transformers on the actor's exported weights."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Not here, covered elsewhere: a PP2 actor syncs in test_shapes_sync.py[one_kv_head] (a MoE model's
# export at PP2 and TP2xPP2: tests/distributed/test_weights_dist.py), a TP2xEP2 MoE actor in
# test_shapes_sync.py[moe_i48]; both into a TP2 engine (a TP1 engine's load is the same as below).
LAYOUTS = {"tp2": ["--tp", "2", "--etp", "2"], "ep2": ["--ep", "2"],
           # two sending ranks (each EP rank sends its experts), so two gloo groups into one engine
           "ep2_broadcast": ["--ep", "2", "--transport", "broadcast"],
           # a TP2 engine: checksums merged from its two workers' slices
           "tp2_rollout_tp2": ["--tp", "2", "--etp", "2", "--rollout-tp", "2"]}


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sync_from_sharded_actor_matches_hf(layout, tiny_assets, ray_session):
    from dapo_megatron.tools.check_sync import DEFAULT_TOL, build_parser, check_sync
    hf_dir = str(tiny_assets / "qwen3_moe")
    args = build_parser().parse_args(["--hf-dir", hf_dir, "--device", "cpu", *LAYOUTS[layout]])
    out = check_sync(hf_dir, args)
    assert out["checksums"] == "compared"  # a mismatch would have raised, naming the tensor
    assert out["weight_change"] > 1e-4, "the optimizer step must change the weights for the check to mean anything"
    assert out["max_abs_logprob_diff"] < DEFAULT_TOL, out


def test_sync_vl_model_matches_hf_with_images(tiny_vl_model, ray_session):
    """Qwen3-VL-MoE: the step trains on the engine's responses to image prompts (the vision tower
    moves), the sync's checksums cover the tower and the per-expert tensors under their HF names
    (a mismatch raises), and the engine's log-probs of responses to image prompts equal HF's
    Qwen3-VL on the exported weights (pixel values from the same processor)."""
    from dapo_megatron.tools.check_sync import DEFAULT_TOL, build_parser, check_sync
    hf_dir = str(tiny_vl_model)
    args = build_parser().parse_args(["--hf-dir", hf_dir, "--device", "cpu", "--ep", "2"])
    out = check_sync(hf_dir, args)
    print(f"qwen3_vl_moe check_sync (EP2): {out}")
    assert out["checksums"] == "compared" and out["image_prompts"] == 2
    assert out["weight_change"] > 1e-4 and out["vision_weight_change"] > 1e-4
    assert out["max_abs_logprob_diff"] < DEFAULT_TOL, out


def test_cli_reports_and_rejects_bad_input(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "dapo_megatron.tools.check_sync", "--hf-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--hf-dir" in r.stderr and "config.json" in r.stderr
