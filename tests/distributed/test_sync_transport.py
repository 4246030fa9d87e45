"""The broadcast weight-sync transport (weights/collective.py) over real gloo groups."""
import pytest
import torch

from dapo_megatron.train.parallel import free_port, run_workers

import dist_jobs
from actor_jobs import unpack

pytestmark = pytest.mark.distributed


def test_broadcast_transport_two_senders_into_one_receiver():
    """weights/collective.py over gloo: what each sender broadcast arrives bit-exact, with its
    dtype and shape, at a receiver that serves both senders' groups at once."""
    blobs = run_workers(dist_jobs.broadcast_sync_job, 3, [free_port(), free_port()], timeout_s=120)
    sent0, sent1, received = map(unpack, blobs)
    assert received["counts"] == [5, 5]
    expected = {**sent0, **sent1}
    assert set(received["got"]) == set(expected)
    for name, t in expected.items():
        got = received["got"][name]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name
