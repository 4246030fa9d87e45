"""Prompt sampler: seeded per-epoch shuffles, epoch crossing, exact resume, push_back."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_megatron.data.sampler import PromptSampler


def take(sampler, sizes):
    return [sampler.next(size) for size in sizes]


def test_each_epoch_is_a_seeded_permutation():
    s = PromptSampler(10, shuffle=True, seed=3)
    epoch0, epoch1 = s.next(10), s.next(10)
    assert sorted(epoch0) == sorted(epoch1) == list(range(10)) and epoch0 != epoch1
    assert s.epoch == 2 and s.position == 0
    again = PromptSampler(10, shuffle=True, seed=3)
    assert again.next(20) == epoch0 + epoch1
    assert PromptSampler(10, shuffle=True, seed=4).next(10) != epoch0
    assert PromptSampler(10, shuffle=False, seed=3).next(15) == list(range(10)) + list(range(5))


def test_batches_cross_epoch_boundaries():
    s = PromptSampler(7, shuffle=True, seed=0)
    first = s.next(5)
    assert s.epoch == 0 and s.position == 5
    crossing = s.next(5)  # 2 from epoch 0, 3 from epoch 1
    assert sorted(first + crossing[:2]) == list(range(7)) and s.epoch == 1 and s.position == 3
    big = s.next(20)  # larger than the dataset: spans epochs 1..4
    assert len(big) == 20 and s.epoch == 4 and s.position == 2
    reference = PromptSampler(7, shuffle=True, seed=0).next(30)
    assert first + crossing + big == reference


def test_state_dict_resumes_exactly():
    full = PromptSampler(13, shuffle=True, seed=1)
    uninterrupted = take(full, [4, 6, 5, 9, 3, 13, 2])
    s = PromptSampler(13, shuffle=True, seed=1)
    head = take(s, [4, 6, 5])
    state = json.loads(json.dumps(s.state_dict()))  # survives a JSON checkpoint
    resumed = PromptSampler(13, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    assert head + take(resumed, [9, 3, 13, 2]) == uninterrupted
    assert resumed.epoch == full.epoch and resumed.position == full.position


def test_push_back_is_served_first_and_saved():
    s = PromptSampler(10, shuffle=True, seed=2)
    reference = PromptSampler(10, shuffle=True, seed=2).next(30)
    batch = s.next(6)
    used, unused = batch[:2], batch[2:]
    s.push_back(unused)
    state = s.state_dict()
    assert state["pushed_back"] == unused
    nxt = s.next(3)
    assert nxt == unused[:3]
    rest = s.next(5)
    assert rest == unused[3:] + reference[6:10]
    # Resuming with prompts still pushed back serves them first as well.
    r = PromptSampler(10, shuffle=True, seed=2)
    r.load_state_dict(state)
    assert r.next(6) == unused + reference[6:8]
    # No prompt is lost or duplicated over the stream: used + everything after = the reference.
    s2 = PromptSampler(10, shuffle=True, seed=2)
    b = s2.next(6)
    s2.push_back(b[2:])
    assert b[:2] + s2.next(28) == reference[:30]


def test_later_push_goes_in_front():
    s = PromptSampler(10, shuffle=False, seed=0)
    s.next(6)
    s.push_back([4, 5])
    s.push_back([1])
    assert s.next(4) == [1, 4, 5, 6]


def test_errors():
    with pytest.raises(ValueError, match="empty"):
        PromptSampler(0, shuffle=True, seed=0)
    s = PromptSampler(5, shuffle=True, seed=0)
    with pytest.raises(ValueError, match="outside"):
        s.push_back([5])
    with pytest.raises(ValueError, match="positive"):
        s.next(0)
    other = PromptSampler(6, shuffle=True, seed=0)
    with pytest.raises(ValueError, match="data.train_files"):
        other.load_state_dict(s.state_dict())


def test_resume_keeps_the_saved_seed(caplog):
    s = PromptSampler(8, shuffle=True, seed=1)
    s.next(3)
    reference = PromptSampler(8, shuffle=True, seed=1).next(11)[3:]
    changed = PromptSampler(8, shuffle=True, seed=99)
    changed.load_state_dict(s.state_dict())
    assert changed.next(8) == reference and "data.seed=1" in caplog.text


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), seed=st.integers(0, 3), sizes=st.lists(st.integers(1, 15), min_size=1, max_size=8),
       cut=st.integers(0, 8), push=st.integers(0, 15))
def test_resume_anywhere_matches_uninterrupted(n, seed, sizes, cut, push):
    """Interrupt after `cut` batches (with some of the last batch pushed back): same stream after,
    and since pushed-back prompts return to where they were, the plain stream without pushes."""
    def run(interrupt: bool):
        s = PromptSampler(n, shuffle=True, seed=seed)
        out = []
        for i, size in enumerate(sizes):
            batch = s.next(size)
            if i == cut - 1:
                s.push_back(batch[len(batch) - min(push, len(batch)):])
                batch = batch[:len(batch) - min(push, len(batch))]
                if interrupt:
                    state = s.state_dict()
                    s = PromptSampler(n, shuffle=True, seed=seed)
                    s.load_state_dict(state)
            out += batch
        return out + s.next(2 * n)
    served = run(False)
    assert run(True) == served == PromptSampler(n, shuffle=True, seed=seed).next(len(served))
