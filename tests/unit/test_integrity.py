"""train/integrity: a dist checkpoint folder's size + CRC32 manifest, and the check that names
the first damaged file (single process: no process group, rank 0 of 1)."""
import json
import os
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dapo_megatron.train.integrity import MANIFEST, _share, check, digest, write_manifest
from dapo_megatron.weights.hf_io import CheckpointError


def _megatron_files(root):
    """The two files megatron-core adds to torch DCP's output (their content is not read here)."""
    with open(root / "metadata.json", "w") as f:
        json.dump({"sharded_backend": "torch_dist"}, f)
    torch.save({"common": 1}, root / "common.pt")


@pytest.fixture
def ckpt(tmp_path):
    """A real torch DCP checkpoint (one process) plus megatron's two files and an rng subfolder."""
    root = tmp_path / "step_2"
    state = {"decoder.weight": torch.randn(64, 32), "embedding.weight": torch.randn(128, 32)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(root)), no_dist=True)
    _megatron_files(root)
    (root / "rng").mkdir()
    torch.save({"seed": 3}, root / "rng" / "rank_0.pt")
    return root


def _distcp(root):
    return sorted(root.glob("*.distcp"))[0]


def test_digest_is_size_and_zlib_crc32(tmp_path):
    data = os.urandom(40 << 20)  # more than one read block
    (tmp_path / "f").write_bytes(data)
    assert digest(str(tmp_path / "f")) == (len(data), f"{zlib.crc32(data):08x}")


def test_manifest_lists_every_file_and_a_clean_folder_passes(ckpt):
    write_manifest(str(ckpt))
    entries = json.loads((ckpt / MANIFEST).read_text())["crc32"]
    on_disk = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()} - {MANIFEST}
    assert set(entries) == on_disk and "rng/rank_0.pt" in entries and ".metadata" in entries
    check(str(ckpt))
    (ckpt / "notes.txt").write_text("a file the manifest does not list is not checked")
    check(str(ckpt))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "rng"])
def test_damage_is_named(ckpt, damage):
    write_manifest(str(ckpt))
    path = ckpt / "rng" / "rank_0.pt" if damage == "rng" else _distcp(ckpt)
    data = bytearray(path.read_bytes())
    if damage == "delete":
        path.unlink()
    elif damage == "truncate":
        path.write_bytes(data[:-100])
    else:  # one bit, in the middle: same size, different bytes
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
    expect = {"flip": "CRC32", "rng": "CRC32", "truncate": "truncated", "delete": "is missing"}[damage]
    with pytest.raises(CheckpointError, match=expect) as err:
        check(str(ckpt))
    assert str(path) in str(err.value)


def test_without_a_manifest_the_byte_ranges_of_dot_metadata_are_checked(ckpt):
    check(str(ckpt))  # no manifest: structure only
    path = _distcp(ckpt)
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(CheckpointError, match="truncated") as err:
        check(str(ckpt))
    assert str(path) in str(err.value)
    path.unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        check(str(ckpt))


@pytest.mark.parametrize("name", ["metadata.json", ".metadata", "common.pt"])
def test_a_missing_megatron_file_is_named(ckpt, name):
    (ckpt / name).unlink()
    with pytest.raises(CheckpointError, match=f"{name} is missing"):
        check(str(ckpt))


@pytest.mark.parametrize("name,expect", [("metadata.json", "not valid JSON"), (".metadata", "cannot read")])
def test_an_unreadable_metadata_file_is_named(ckpt, name, expect):
    (ckpt / name).write_text("{")
    with pytest.raises(CheckpointError, match=expect) as err:
        check(str(ckpt))
    assert str(ckpt / name) in str(err.value)


def test_a_damaged_manifest_is_named(ckpt):
    write_manifest(str(ckpt))
    (ckpt / MANIFEST).write_text('{"crc32": ')
    with pytest.raises(CheckpointError, match=MANIFEST):
        check(str(ckpt))


def test_each_rank_digests_the_files_it_wrote():
    files = [".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp", "common.pt",
             "metadata.json", "rng/rank_0.pt", "rng/rank_1.pt"]
    shares = [_share(files, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(files)  # each file exactly once
    assert {"__0_0.distcp", "__0_1.distcp", "rng/rank_0.pt"} <= set(shares[0])
    assert {"__1_0.distcp", "__1_1.distcp", "rng/rank_1.pt"} <= set(shares[1])
    assert sorted(_share(files, 0, 1)) == sorted(files)
