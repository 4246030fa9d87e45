"""Device-layer checks on a real accelerator; skipped on CPU machines."""
import pytest
import torch

from dapo_megatron.device import detect, get_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(detect() == "cpu", reason="needs an accelerator")]


def test_accelerator_round_trip_and_memory():
    dev = get_device("auto")
    dev.set_device(0)
    x = torch.arange(1 << 20, dtype=torch.float32, device=dev.torch_device(0))
    dev.synchronize()
    assert torch.equal(x.cpu(), torch.arange(1 << 20, dtype=torch.float32))
    mem = dev.memory_gb()
    assert mem["allocated"] > 0 and mem["peak"] >= mem["allocated"]


def test_accelerator_rng_state_round_trip():
    dev = get_device("auto")
    dev.manual_seed(3)
    state = dev.rng_state()
    a = torch.rand(4, device=dev.torch_device(0))
    dev.set_rng_state(state)
    assert torch.equal(a, torch.rand(4, device=dev.torch_device(0)))
