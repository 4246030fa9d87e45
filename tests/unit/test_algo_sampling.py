"""Dynamic sampling: the group filter and the round accumulator."""
import pytest
import torch

from dapo_megatron.algo import DynamicSampler, Group, filter_groups


def test_filter_groups_cases():
    # group 0 all 1, group 1 all 0 (dropped); group 2 mixed and group 3 singleton (kept); interleaved order
    values = torch.tensor([1.0, 0.0, 1.0, 0.0, 7.0, 1.0, 0.0])
    index = torch.tensor([0, 1, 0, 2, 3, 2, 1])
    keep = filter_groups(values, index)
    assert keep.tolist() == [False, False, False, True, True, True, False]


def test_filter_groups_all_identical_drops_everything():
    assert not filter_groups(torch.ones(4), torch.tensor([0, 0, 1, 1])).any()


def _round(*metric_lists):
    return [Group(list(values), payload=name) for name, values in metric_lists]


def test_sampler_fills_exactly_and_truncates_in_arrival_order():
    s = DynamicSampler(train_batch_size=3, max_num_gen_batches=10, on_exhausted="error")
    s.add(_round(("a", [1, 0]), ("b", [1, 1]), ("c", [0, 1])))
    assert not s.should_stop()
    s.add(_round(("d", [0, 0]), ("e", [1, 0]), ("f", [0, 1])))
    assert s.is_full and s.should_stop()
    assert s.metrics() == {"dynamic_sampling/num_gen_batches": 2, "dynamic_sampling/generated_groups": 6,
                           "dynamic_sampling/kept_groups": 4}
    assert [g.payload for g in s.take()] == ["a", "c", "e"]
    assert s.metrics()["dynamic_sampling/num_gen_batches"] == 0 and not s.should_stop()
    assert s.state_dict() == {"gen_batches": 2, "generated_groups": 6, "kept_groups": 4, "steps": 1}


def test_sampler_exhausted_error_names_keys():
    s = DynamicSampler(train_batch_size=2, max_num_gen_batches=2, on_exhausted="error")
    s.add(_round(("a", [1, 1])))
    assert not s.should_stop()
    s.add(_round(("b", [0, 1])))
    assert s.should_stop() and not s.is_full
    with pytest.raises(RuntimeError, match=r"max_num_gen_batches.*on_exhausted"):
        s.take()


def test_sampler_exhausted_train_partial_warns():
    s = DynamicSampler(train_batch_size=2, max_num_gen_batches=1, on_exhausted="train_partial")
    s.add(_round(("a", [1, 1]), ("b", [0, 1])))
    with pytest.warns(RuntimeWarning, match="max_num_gen_batches"):
        assert [g.payload for g in s.take()] == ["b"]


def test_sampler_without_round_limit_and_early_take():
    s = DynamicSampler(train_batch_size=1, max_num_gen_batches=0)
    for _ in range(20):
        s.add(_round(("a", [1, 1])))
    assert not s.should_stop()
    with pytest.raises(RuntimeError, match="should_stop"):
        s.take()


def test_sampler_disabled_keeps_everything():
    s = DynamicSampler(train_batch_size=2, max_num_gen_batches=1, enable=False)
    s.add(_round(("a", [1, 1]), ("b", [0, 0]), ("c", [1, 0])))
    assert [g.payload for g in s.take()] == ["a", "b"]


def test_sampler_rejects_bad_config():
    with pytest.raises(ValueError, match=r"algorithm\.filter_groups\.on_exhausted"):
        DynamicSampler(train_batch_size=2, max_num_gen_batches=1, on_exhausted="skip")
    with pytest.raises(ValueError, match=r"data\.train_batch_size"):
        DynamicSampler(train_batch_size=0, max_num_gen_batches=1)


def test_sampler_state_dict_round_trip():
    s = DynamicSampler(train_batch_size=1, max_num_gen_batches=3)
    s.add(_round(("a", [1, 1]), ("b", [1, 0])))
    s.take()
    restored = DynamicSampler(train_batch_size=1, max_num_gen_batches=3)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == {"gen_batches": 1, "generated_groups": 2, "kept_groups": 1, "steps": 1}
    restored.add(_round(("c", [0, 1])))
    assert restored.state_dict()["gen_batches"] == 2 and restored.state_dict()["kept_groups"] == 2
    with pytest.raises(KeyError, match="steps"):
        restored.load_state_dict({"gen_batches": 1, "generated_groups": 2, "kept_groups": 1})


def test_early_stop_rounds_are_counted_by_start_round():
    s = DynamicSampler(train_batch_size=2, max_num_gen_batches=2)
    s.start_round()
    s.add([Group([1.0, 0.0])], new_round=False)
    s.add([Group([1.0, 1.0])], new_round=False)
    assert s.metrics()["dynamic_sampling/num_gen_batches"] == 1 and not s.should_stop()
    s.start_round()
    assert s.exhausted and s.metrics()["dynamic_sampling/generated_groups"] == 2
    s.add([Group([0.0, 1.0])], new_round=False)
    assert s.is_full and len(s.take()) == 2 and s.state_dict()["gen_batches"] == 2


def test_groups_to_fill_follows_the_keep_rate_of_all_steps():
    import math
    s = DynamicSampler(train_batch_size=4, max_num_gen_batches=0)
    assert s.groups_to_fill() == 4  # nothing seen yet: assume every group is kept
    s.add([Group([1.0, 0.0]), Group([1.0, 1.0]), Group([0.0, 0.0]), Group([0.0, 0.0])], new_round=False)
    assert s.groups_to_fill() == 12  # 3 missing at 1 kept in 4
    assert s.groups_to_fill(batches_after=2) == 44  # async carrying groups: two more batches of 4 too
    s.add([Group([1.0, 0.0])] * 3, new_round=False)
    assert s.is_full and s.groups_to_fill() == 0 and s.groups_to_fill(batches_after=1) == 0  # this batch is done
    s.take()
    assert s.groups_to_fill() == math.ceil(4 * 7 / 4)  # the rate carries over to the next step
    none_kept = DynamicSampler(train_batch_size=2, max_num_gen_batches=0)
    none_kept.add([Group([1.0, 1.0])], new_round=False)
    assert none_kept.groups_to_fill() == math.inf
