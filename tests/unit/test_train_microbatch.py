"""Dynamic batch size planning (pure torch): DP split, token-budget bins, packing, harmonising."""
import torch

from dapo_megatron.batch import RolloutBatch
from dapo_megatron.train import microbatch as mb


def _batch(prompt_lens, response_lens):
    prompts = [torch.arange(1, p + 1) for p in prompt_lens]
    responses = [torch.arange(100, 100 + r) for r in response_lens]
    b = RolloutBatch(prompts=prompts, responses=responses, group=torch.zeros(len(prompts), dtype=torch.long),
                     prompt_index=torch.zeros(len(prompts), dtype=torch.long))
    b.advantages = torch.arange(len(prompts)).float()  # [B]
    return b


def test_split_for_dp_covers_every_sample_once_and_balances():
    lengths = [10, 3, 7, 7, 1, 12, 5]
    shares = mb.split_for_dp(lengths, 3)
    assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
    assert all(s == sorted(s) for s in shares)
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(lengths)


def test_token_bins_respect_budget_and_keep_overlong_alone():
    lengths = [5, 9, 3, 30, 8, 2, 7]
    bins = mb.token_bins(lengths, max_tokens=20, seq_multiple=2)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        padded = mb.round_up(max(lengths[i] for i in b), 2)
        assert len(b) == 1 or len(b) * padded <= 20
    assert [3] in bins  # longer than the budget: its own micro-batch


def test_build_microbatch_aligns_responses():
    batch = _batch([3, 1], [2, 4])
    micro = mb.build_microbatch(batch, [1, 0], rows=3, seq_len=6, width=4)
    assert micro.index == [1, 0, -1]
    assert micro.tokens[0, :5].tolist() == [1, 100, 101, 102, 103]
    assert micro.labels[0, :4].tolist() == [100, 101, 102, 103]  # position t predicts token t + 1
    assert micro.loss_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert micro.advantages.tolist() == [1, 0, 0]  # [b]: per sample; the padding row holds the pad
    assert micro.prompt_index.tolist() == [0, 0, 0] and micro.old_logprobs is None
    assert micro.num_tokens == 3 + 1 + 2 + 4


def test_harmonize_pads_count_and_shapes_without_a_group():
    batch = _batch([2, 2, 2], [3, 1, 6])
    plan = mb.plan_microbatches(batch, [0, 1, 2], max_tokens=10, seq_multiple=4)
    out = mb.harmonize(plan, None, min_count=2, count_multiple=4, seq_multiple=4)
    assert len(out.bins) == len(out.shapes) == 4
    assert all(s % 4 == 0 for _, s in out.shapes)
    micros = mb.materialize(batch, out)
    assert sorted(i for m in micros for i in m.index if i >= 0) == [0, 1, 2]


def test_image_fields_follow_their_rows_into_micro_batches():
    """A micro-batch's pixel rows are its samples' images, row after row; a text row adds none,
    padding rows none, and selecting / joining batches keeps each sample's own images."""
    grids = [torch.tensor([[1, 2, 4]]), torch.zeros(0, 3, dtype=torch.long), torch.tensor([[1, 2, 2], [1, 4, 2]])]
    pixels = [torch.full((int(g.prod(-1).sum()), 5), float(i)) for i, g in enumerate(grids)]
    batch = RolloutBatch.from_samples([
        dict(prompts=[1] * (3 + i), responses=[2] * (2 + i), pixel_values=p, image_grid_thw=g)
        for i, (p, g) in enumerate(zip(pixels, grids))])
    batch = RolloutBatch.concat([batch.select([2, 1]), batch.select([0])])  # samples 2, 1, 0
    micro = mb.build_microbatch(batch, [2, 1, 0], rows=4, seq_len=10, width=batch.loss_mask.shape[1])
    assert micro.image_grid_thw.tolist() == [[1, 2, 4], [1, 2, 2], [1, 4, 2]]
    assert micro.pixel_values[:, 0].tolist() == [0.0] * 8 + [2.0] * 12
    text_only = mb.build_microbatch(batch, [1], rows=2, seq_len=10, width=batch.loss_mask.shape[1])
    assert text_only.pixel_values is None and text_only.image_grid_thw is None
