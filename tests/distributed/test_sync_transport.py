"""Both weight-sync transports of weights/transport.py, each through both of its sides: broadcast
over real gloo groups, object_store through a real Ray object store into an engine-like actor."""
import os

import pytest
import torch

from dapo_megatron.parallel import free_port
from dapo_megatron.train.parallel import run_workers
from dapo_megatron.weights.transport import TRANSPORTS, BroadcastTransport, ObjectStoreTransport

import dist_jobs
from actor_jobs import unpack

pytestmark = pytest.mark.distributed


def test_the_table_names_every_transport():
    assert TRANSPORTS == {"object_store": ObjectStoreTransport, "broadcast": BroadcastTransport}


def test_broadcast_transport_two_senders_into_one_receiver():
    """What each sender broadcast arrives bit-exact, with its dtype and shape, at a receiver that
    serves both senders' groups at once (one group per sender, kept by the receiving side)."""
    blobs = run_workers(dist_jobs.broadcast_sync_job, 3, [free_port(), free_port()], timeout_s=120)
    sent0, sent1, received = map(unpack, blobs)
    assert received["counts"] == [5, 5] and received["groups"] == 2
    expected = {**sent0, **sent1}
    assert set(received["got"]) == set(expected)
    for name, t in expected.items():
        got = received["got"][name]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name


def test_broadcast_wiring_asks_every_engine_to_receive_from_every_sender():
    class FakeEngineHandle:  # records the Ray calls the driver would make
        def __init__(self, name):
            self.receive_weights = self
            self.name, self.calls = name, []

        def remote(self, *args):
            self.calls.append(args)
            return (self.name, args)

    engines = [FakeEngineHandle("e0"), FakeEngineHandle("e1")]
    refs = BroadcastTransport.start_receivers(engines, [("h", 1), None, ("h", 2)])
    assert refs == [("e0", (("h", 1), 1, 3)), ("e1", (("h", 1), 2, 3)), ("e0", (("h", 2), 1, 3)),
                    ("e1", (("h", 2), 2, 3))]
    t = BroadcastTransport(None)
    assert t.listen(False) is None
    with pytest.raises(RuntimeError, match="no broadcast group"):
        t.sender(engines, None).send([("w", torch.zeros(1))])


def test_object_store_transport_into_an_engine_like_actor(local_ray):
    """The sender puts each bucket in the object store once and every engine's load_weights reads
    it; flush waits for the loads; there is nothing to listen on and no receiver to start. An
    engine that dies mid-sync (its process exits in the second bucket) is reported in `dead` and
    sent nothing more; the others get every bucket."""
    from dapo_megatron.device import get_device
    ray = local_ray
    sinks = []
    try:
        @ray.remote(num_cpus=0)
        class Sink:
            def __init__(self, dies_at: int = 0):
                self.got, self.dies_at, self.buckets = {}, dies_at, 0

            def load_weights(self, bucket):
                self.buckets += 1
                if self.buckets == self.dies_at:
                    os._exit(1)
                self.got.update((name, t.clone()) for name, t in bucket)
                return len(bucket)

            def held(self):
                return self.got

        sinks = [Sink.remote(), Sink.remote(dies_at=2), Sink.remote()]
        t = ObjectStoreTransport(get_device("cpu"))
        assert t.listen(True) is None and ObjectStoreTransport.start_receivers(sinks, [None]) == []
        sender = t.sender(sinks, None)
        buckets = [[("a", torch.randn(4, 3)), ("b", torch.arange(6).bfloat16())], [("c", torch.tensor([True, False]))],
                   [("d", torch.ones(2))]]
        for bucket in buckets:
            sender.send(bucket)
        sender.close()
        assert sender.dead == {1}
        del sinks[1]
        for held in ray.get([s.held.remote() for s in sinks]):
            assert set(held) == {"a", "b", "c", "d"}
            for name, tensor in (pair for bucket in buckets for pair in bucket):
                assert held[name].dtype == tensor.dtype and torch.equal(held[name], tensor), name
        with pytest.raises(RuntimeError, match="no receiving side"):
            t.receive(("h", 1), 1, 2, lambda bucket: 0)
    finally:
        for sink in sinks:
            ray.kill(sink)
