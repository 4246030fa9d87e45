"""The vision-language model's weight sync into a vLLM-CPU engine, checked the way a user would
(`python -m dapo_megatron.tools.check_sync`): the actor takes an optimizer step, syncs through
the driver's path (owner routing, checksums), and the engine's log-probs of sampled tokens must
equal HF transformers on the actor's exported weights; and the command's answer to bad input."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# The text layouts are covered where a run already starts: into a TP1 engine through the object
# store, the EP2 actor in every step of test_driver.py's quickstart runs and the TP2 / ETP2 actor in
# its tp2 run (checksums compared at each sync, engine vs actor log-probs asserted); into a TP2
# engine, test_shapes_sync.py: EP2 through the broadcast transport (two senders) [a3b_like], TP2xEP2
# [moe_i48], TP2 / ETP2 [qwen25_like], PP2 [one_kv_head]. Expert export at ETP2 and at PP2 / TP2xPP2:
# tests/distributed/test_weights_dist.py.


def test_sync_vl_model_matches_hf_with_images(tiny_vl_model, local_ray):
    """Qwen3-VL-MoE: the step trains on the engine's responses to image prompts (the vision tower
    moves), the sync's checksums cover the tower and the per-expert tensors under their HF names
    (a mismatch raises), and the engine's log-probs of responses to image prompts equal HF's
    Qwen3-VL on the exported weights (pixel values from the same processor)."""
    from dapo_megatron.tools.check_sync import DEFAULT_TOL, build_parser
    from dapo_megatron.tools.check_sync.run import check_sync
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
