"""The memory plan's activation and logits terms (plan/activations.py) against what a CPU rank
really holds: the peak resident set of one update above its idle baseline (weights, main grads,
Adam state already allocated), at two sequence lengths, on a MoE model big enough that each
term is >= 0.5 GB. fp32, TP1, Megatron's unfused attention: the CPU's kernel profile (the plan
takes flash attention on GPUs / NPUs, which drops the heads x S^2 term; unmeasured here)."""
import pytest

from dapo_megatron.train.parallel import run_workers

import memory_jobs

pytestmark = [pytest.mark.distributed, pytest.mark.background]

ROWS, LENGTHS = 2, (1024, 1536)  # one micro-batch of two sequences each


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from dapo_megatron.assets.models import build_tiny_model
    # hidden 512, expert FFN 352, dense FFN 1408, GQA 8 : 2, 8 experts top-2, a 32k vocabulary
    hf = build_tiny_model("qwen3_moe", str(tmp_path_factory.mktemp("plan_moe")), vocab_size=32000, hidden_size=512,
                          intermediate_size=1408, moe_intermediate_size=352, num_experts=8, num_experts_per_tok=2,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                          max_position_embeddings=4096)
    return hf, run_workers(memory_jobs.activation_peaks, 1, hf, list(LENGTHS), ROWS, timeout_s=600)[0]


def test_activations_and_logits_within_25_percent_of_the_measured_peak(measured):
    from dapo_megatron.config.schema import ParallelConfig
    from dapo_megatron.models.spec import ModelSpec
    from dapo_megatron.plan.activations import shape_of, training_bytes
    hf, peaks = measured
    spec = ModelSpec.from_pretrained(hf)
    shape = shape_of(spec, ParallelConfig(), dtype_bytes=4)
    predicted = []
    for length, peak in zip(LENGTHS, peaks):
        # actor_jobs.actor_config trains with an entropy bonus: its gradient keeps two more fp32 [T, V]
        terms = training_bytes(shape, layers=spec.num_layers, in_flight=1, tokens=ROWS * length, seq_len=length,
                               flash=False, recompute="", last_stage=True, entropy_grad=True)
        assert min(terms.values()) >= 0.5e9, terms  # each checked term is big enough to see
        predicted.append(sum(terms.values()))
        assert 0.75 <= predicted[-1] / peak <= 1.25, (length, terms, peak)
    slope = (predicted[1] - predicted[0]) / (peaks[1] - peaks[0])  # bytes per added token agree too
    assert 0.75 <= slope <= 1.25, (predicted, peaks)
