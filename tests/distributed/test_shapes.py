"""Every test shape (`assets.models.TEST_SHAPES`) through the converter and the Megatron model,
the way a user runs them: HF -> dist checkpoint (convert CLI) at one layout; that checkpoint
loaded at a second layout gives HF transformers' logits on prompts of real length
(checkpoint_tools/verify.py); exported back at the second layout it is bit-exact HF."""
import pytest

from test_convert import _convert, _error_line, _same_tensors, cli_here

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.background]

LOGITS_TOL = 1e-4  # fp32; measured 4.5e-7 .. 1.2e-6
PROMPT_LENGTHS = [300, 37, 129]  # DAPO-Math prompts run ~100-300 tokens
# shape -> (layout the checkpoint is written at, layout it is read back at)
LAYOUTS = {
    "a3b_like": (["--tp", 2, "--ep", 2], ["--pp", 2]),
    "moe_i48": (["--tp", 2, "--ep", 2], ["--ep", 2]),  # 3 layers: no PP 2
    "qwen25_like": (["--pp", 2], ["--tp", 2]),
    "one_kv_head": (["--pp", 2], []),  # one KV head: no TP
}


def _layout(flags: list) -> dict:
    return {"tp": 1, "pp": 1, "ep": 1, "etp": 1, **{str(k).lstrip("-"): int(v) for k, v in zip(flags[::2], flags[1::2])}}


@pytest.mark.parametrize("shape", list(LAYOUTS))
def test_convert_round_trip_and_logits_vs_hf(shape, shape_model, tmp_path):
    from checkpoint_tools.verify import verify
    hf, (save, load) = shape_model(shape), LAYOUTS[shape]
    ckpt, back = tmp_path / "mcore", tmp_path / "hf_back"
    proc = _convert("hf-to-mcore", "--hf-dir", hf, "--out", ckpt, *save)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = verify(hf, _layout(load), [], str(ckpt), lengths=PROMPT_LENGTHS)
    print(f"{shape}: saved at {_layout(save)}, loaded at {_layout(load)}: max |logits - HF| per prompt "
          + ", ".join(f"{d:.2e}" for d in diffs))
    assert max(diffs) <= LOGITS_TOL, diffs
    proc = _convert("mcore-to-hf", "--ckpt", ckpt, "--out", back, *load)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_tensors(hf, str(back))


def test_a_layout_the_shape_cannot_take_is_one_line(shape_model, tmp_path):
    """TP over a single KV head: refused before any worker starts, naming the flag."""
    proc = _convert("hf-to-mcore", "--hf-dir", shape_model("one_kv_head"), "--out", tmp_path / "x", "--tp", 2)
    assert proc.returncode == 2 and "--tp" in _error_line(proc) and "key-value heads (1)" in _error_line(proc)
    from checkpoint_tools.verify import main
    verify = cli_here(main, "--hf-dir", shape_model("one_kv_head"), "--tp", "2")
    assert verify.returncode == 2 and "--tp" in _error_line(verify)
