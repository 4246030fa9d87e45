"""The converter's helpers: which fused-weight merges are the parameter itself, tensors
torch.save writes without their neighbours' bytes, and a broken metadata file named in its error."""
import io

import pytest
import torch

from dapo_megatron.convert.ranks import _exact_storage, _merge_in_place, _tiles


def test_tiles_accepts_in_order_views_that_fill_the_tensor():
    fc1 = torch.randn(8, 4)
    gate, up = torch.chunk(fc1, 2, dim=0)
    assert _tiles(fc1, [gate, up])
    assert not _tiles(fc1, [up, gate])  # out of order: cat would swap the halves
    assert not _tiles(fc1, [gate])  # covers half
    assert not _tiles(fc1, [gate.clone(), up])  # a copy, not the parameter's memory
    assert not _tiles(fc1, [gate, up.to(torch.float64)])
    cols = torch.chunk(fc1, 2, dim=1)  # views, but cat along dim 0 does not rebuild fc1
    assert not _tiles(fc1, list(cols))
    assert not _tiles(fc1, "not a list")


def test_merge_in_place_returns_the_parameter_or_falls_back_to_the_merge():
    fc1 = torch.randn(6, 3)
    merge = _merge_in_place(fc1, lambda pieces: torch.cat(pieces))
    assert merge(list(torch.chunk(fc1, 2))) is fc1
    pieces = [t.clone() for t in torch.chunk(fc1, 2)]
    merged = merge(pieces)
    assert merged is not fc1 and torch.equal(merged, fc1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_storage_aliases_a_contiguous_view(dtype):
    fc1 = torch.randn(64, 32).to(dtype)
    up = torch.chunk(fc1, 2, dim=0)[1]
    alias = _exact_storage(up)
    assert alias.data_ptr() == up.data_ptr()  # no copy
    assert alias.untyped_storage().nbytes() == up.numel() * up.element_size()
    assert alias.dtype == dtype and torch.equal(alias, up)
    saved_view, saved_alias = io.BytesIO(), io.BytesIO()
    torch.save(up, saved_view)
    torch.save(alias, saved_alias)
    assert len(saved_alias.getvalue()) < len(saved_view.getvalue()) - up.numel() * up.element_size() // 2
    del fc1, up
    assert torch.equal(torch.load(io.BytesIO(saved_alias.getvalue())), alias)  # alive without fc1


def test_exact_storage_keeps_an_exact_tensor_and_clones_a_strided_view():
    t = torch.randn(4, 6)
    assert _exact_storage(t).data_ptr() == t.data_ptr()
    cols = t[:, :3]
    copy = _exact_storage(cols)
    assert copy.is_contiguous() and copy.data_ptr() != t.data_ptr() and torch.equal(copy, cols)
    assert copy.untyped_storage().nbytes() == copy.numel() * copy.element_size()


@pytest.mark.parametrize("text,expect", [("{", "is not valid JSON"), ('{"layout": {}}', "has no 'dtype'"),
                                         ("[1]", "has no 'dtype'")])
def test_a_broken_metadata_file_is_named(tmp_path, text, expect):
    from dapo_megatron.convert.run import META_FILE, UsageError, _ckpt_dtype
    (tmp_path / META_FILE).write_text(text)
    with pytest.raises(UsageError, match=expect) as err:
        _ckpt_dtype(str(tmp_path), str(tmp_path))
    assert str(tmp_path / META_FILE) in str(err.value)
