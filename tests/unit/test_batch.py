"""The batch schema: RolloutBatch columns from the FIELDS table; select / concat / from_samples keep
rows aligned; a field added as one table row survives batch building, DP split, micro-batching
and padding with nothing else changed."""
import pytest
import torch

from dapo_megatron.batch import FIELDS, POSITION, Field, RolloutBatch, pad_right
from dapo_megatron.train import microbatch as mb


def _batch(lengths, offset=0):
    responses = [torch.arange(n) + 10 for n in lengths]
    return RolloutBatch(prompts=[torch.tensor([1, 2])] * len(lengths), responses=responses,
                        group=torch.arange(len(lengths)) + offset, prompt_index=torch.arange(len(lengths)) + 100,
                        rollout_logprobs=pad_right([-torch.ones(n) for n in lengths]),
                        finish_reasons=[str(i) for i in range(len(lengths))])


def test_loss_mask_defaults_to_every_response_token():
    b = _batch([3, 0, 1])
    assert b.response_lengths.tolist() == [3, 0, 1]
    assert b.loss_mask.tolist() == [[1, 1, 1], [0, 0, 0], [1, 0, 0]]


def test_select_keeps_rows_aligned():
    b = _batch([3, 1, 2]).select([2, 0])
    assert [r.tolist() for r in b.responses] == [[10, 11], [10, 11, 12]]
    assert b.group.tolist() == [2, 0] and b.finish_reasons == ["2", "0"]
    assert b.rollout_logprobs.tolist() == [[-1, -1, 0], [-1, -1, -1]]
    assert b.loss_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert b.scores is None


def test_concat_repads_token_fields():
    b = RolloutBatch.concat([_batch([1]), _batch([4, 2], offset=5)])
    assert len(b) == 3 and b.group.tolist() == [0, 5, 6] and b.finish_reasons == ["0", "0", "1"]
    assert b.rollout_logprobs.shape == (3, 4) and b.rollout_logprobs[0].tolist() == [-1, 0, 0, 0]
    assert b.loss_mask.sum().item() == 7


def test_unknown_field_is_an_error():
    with pytest.raises(KeyError, match="scorez"):
        RolloutBatch(scorez=torch.zeros(1))
    b = _batch([1])
    with pytest.raises(AttributeError, match="FIELDS"):
        b.advantage = torch.zeros(1)


def test_from_samples_stacks_and_pads_by_scope():
    rows = [dict(prompts=[1, 2, 3], responses=[7], loss_mask=[1.0], rollout_logprobs=[-0.5], group=0,
                 prompt_index=4, scores=1.0, acc=True, finish_reasons="stop"),
            dict(prompts=[1], responses=[8, 9], loss_mask=[1.0, 0.0], rollout_logprobs=[-1.0, -2.0], group=0,
                 prompt_index=4, scores=-1.0, acc=False, finish_reasons="length")]
    b = RolloutBatch.from_samples(rows)
    assert b.prompts[0].dtype == torch.long and [p.tolist() for p in b.prompts] == [[1, 2, 3], [1]]
    assert b.loss_mask.tolist() == [[1, 0], [1, 0]] and b.rollout_logprobs.tolist() == [[-0.5, 0], [-1, -2]]
    assert b.acc.dtype == torch.bool and b.scores.tolist() == [1.0, -1.0] and b.old_logprobs is None
    with pytest.raises(ValueError, match="'scores' is set on 1 of 2"):
        RolloutBatch.from_samples([rows[0], {k: v for k, v in rows[1].items() if k != "scores"}])


def test_a_new_field_is_one_table_row(monkeypatch):
    """A per-position integer field (routed experts are one: [P + R, top_k] per sample) added to
    FIELDS alone goes through from_samples, select, concat, DP split and micro-batching, padded
    with its own pad value and aligned with the tokens."""
    monkeypatch.setitem(FIELDS, "dummy_routes", Field("dummy_routes", POSITION, torch.int16, pad=-1))
    prompts, responses = [[5, 6, 7], [5], [8, 9]], [[1, 2], [3, 4, 5, 6], [7]]
    # value at position t of sample i: 100 * i + t, two columns (like top-2 expert ids)
    samples = [dict(prompts=p, responses=r, group=i, prompt_index=i,
                    dummy_routes=[[100 * i + t, -(100 * i + t)] for t in range(len(p) + len(r))])
               for i, (p, r) in enumerate(zip(prompts, responses))]
    batch = RolloutBatch.concat([RolloutBatch.from_samples(samples[:1]), RolloutBatch.from_samples(samples[1:])])
    assert batch.dummy_routes[1].dtype == torch.int16 and batch.dummy_routes[1].shape == (5, 2)
    picked = batch.select([2, 1])
    assert picked.dummy_routes[0][:, 0].tolist() == [200, 201, 202]

    shares = mb.split_for_dp(batch.sequence_lengths, 2)
    seen = set()
    for share in shares:
        plan = mb.harmonize(mb.plan_microbatches(batch, share, max_tokens=8, seq_multiple=4), None,
                            min_count=3, seq_multiple=4)
        for micro in mb.materialize(batch, plan):
            routes = micro.dummy_routes  # [b, S, 2]
            assert routes.dtype == torch.int16 and routes.shape[:2] == micro.tokens.shape
            for row, i in enumerate(micro.index):
                n = len(prompts[i]) + len(responses[i]) if i >= 0 else 0
                expected = torch.tensor([[100 * i + t, -(100 * i + t)] for t in range(n)], dtype=torch.int16)
                assert torch.equal(routes[row, :n], expected.reshape(n, 2))
                assert (routes[row, n:] == -1).all()  # padding positions and padding rows
                if i >= 0:
                    assert micro.tokens[row, :n].tolist() == prompts[i] + responses[i]
                    seen.add(i)
    assert seen == {0, 1, 2}
    monkeypatch.undo()
    assert "dummy_routes" not in RolloutBatch().columns  # the row is gone with the patch


def test_every_field_says_who_writes_it_who_reads_it_and_where_it_lives():
    """The schema is one table: the passes' read lists and the driver's metadata come from it, and
    no plane field is written that no pass reads."""
    import dataclasses

    from dapo_megatron import batch as schema
    from dapo_megatron.dataplane import StepBatch
    writers = {"engine", "reward", "actor", "ref", "manager", "driver"}
    readers = {schema.READ_BY_REWARD, schema.READ_BY_LOGPROBS, schema.READ_BY_UPDATE}
    for f in schema.FIELDS.values():
        assert f.writer in writers and set(f.readers) <= readers and f.where in (schema.PLANE, schema.STEP, schema.LOCAL)
        assert bool(f.readers) == (f.where == schema.PLANE), f.name  # a plane field somebody reads
    assert set(schema.step_fields()) <= {f.name for f in dataclasses.fields(StepBatch)}
    assert schema.read_by(schema.READ_BY_REWARD) == ("responses",)
    assert set(schema.read_by(schema.READ_BY_UPDATE)) - set(schema.read_by(schema.READ_BY_LOGPROBS)) == {
        "old_logprobs", "ref_logprobs"}
    assert "scores" not in schema.read_by(schema.READ_BY_UPDATE)  # metadata, not a data-plane column
