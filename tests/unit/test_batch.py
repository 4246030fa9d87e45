"""RolloutBatch: masks from ragged responses, select and concat keep rows aligned."""
import torch

from dapo_megatron.batch import RolloutBatch, pad_right


def _batch(lengths, offset=0):
    responses = [torch.arange(n) + 10 for n in lengths]
    return RolloutBatch(prompts=[torch.tensor([1, 2])] * len(lengths), responses=responses,
                        group=torch.arange(len(lengths)) + offset, prompt_index=torch.arange(len(lengths)) + 100,
                        rollout_logprobs=pad_right([-torch.ones(n) for n in lengths]),
                        ground_truths=[str(i) for i in range(len(lengths))])


def test_loss_mask_and_lengths():
    b = _batch([3, 0, 1])
    assert b.response_lengths.tolist() == [3, 0, 1]
    assert b.loss_mask.tolist() == [[1, 1, 1], [0, 0, 0], [1, 0, 0]]


def test_select_keeps_rows_aligned():
    b = _batch([3, 1, 2]).select([2, 0])
    assert [r.tolist() for r in b.responses] == [[10, 11], [10, 11, 12]]
    assert b.group.tolist() == [2, 0] and b.ground_truths == ["2", "0"]
    assert b.rollout_logprobs.tolist() == [[-1, -1, 0], [-1, -1, -1]]
    assert b.scores is None and b.finish_reasons == []


def test_concat_repads_per_token_fields():
    b = RolloutBatch.concat([_batch([1]), _batch([4, 2], offset=5)])
    assert len(b) == 3 and b.group.tolist() == [0, 5, 6]
    assert b.rollout_logprobs.shape == (3, 4) and b.rollout_logprobs[0].tolist() == [-1, 0, 0, 0]
    assert b.loss_mask.sum().item() == 7
