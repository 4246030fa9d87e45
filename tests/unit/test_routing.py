"""Routing replay pieces that need no process group: a router slot's replay / record / recompute
queues and its agreement count, and the engine's routes on their way into a micro-batch."""
import pytest
import torch

from dapo_megatron.batch import RolloutBatch
from dapo_megatron.rollout.types import RolloutGroup
from dapo_megatron.train import microbatch as mb
from dapo_megatron.train.routing import RouterSlot, routing_mode, Routes


def _topk(scores, k, num_groups=None, group_topk=None):
    return torch.topk(scores, k=k, dim=1)


def _scores(tokens=5, experts=7, seed=0):
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))


def test_slot_replays_known_rows_counts_agreement_and_records_what_it_used():
    slot, scores = RouterSlot(layer=0, sequence_parallel=False), _scores()
    own = _topk(scores, 2)[1]
    target = own.clone()
    target[1] = torch.tensor([6, 5]) if set(own[1].tolist()) != {5, 6} else torch.tensor([0, 1])  # disagrees
    target[3] = torch.tensor([own[3, 1], own[3, 0]])  # same set, other order: agrees
    target[4] = -1  # unknown: the router chooses, not counted
    with routing_mode(Routes([slot], 1, 2), replay=True, record=True):
        slot.targets.append(target)
        probs, used = slot.get_replay_topk(scores, 2, default_compute_topk=_topk)
        assert torch.equal(used[:4], target[:4]) and torch.equal(used[4], own[4])
        assert torch.equal(probs, scores.gather(1, used))
        assert (slot.agree, slot.total) == (3, 4)
        assert torch.equal(slot.recorded[0], used)
    assert not slot.targets and not slot.replay  # the mode ends with empty queues


def test_slot_without_targets_routes_freely_and_measure_only_keeps_its_own_choice():
    slot, scores = RouterSlot(0, False), _scores(seed=1)
    own = _topk(scores, 3)
    with routing_mode(Routes([slot], 1, 3)):  # no replay: targets are only compared
        slot.targets.append(torch.zeros(5, 3, dtype=torch.long) + torch.arange(3))
        probs, used = slot.get_replay_topk(scores, 3, default_compute_topk=_topk)
        assert torch.equal(used, own[1]) and torch.equal(probs, own[0])
        probs, used = slot.get_replay_topk(scores, 3, default_compute_topk=_topk)  # queue empty: free
        assert torch.equal(used, own[1])


def test_recompute_under_grad_replays_what_its_forward_used_in_order():
    """Full recompute: forwards run without grad (inside the checkpoint), their recomputes with
    grad, possibly after later forwards (1F1B); each recompute gets its own forward's routes."""
    slot = RouterSlot(0, False)
    first, second = _scores(seed=2), _scores(seed=3)
    t1, t2 = _topk(first, 2)[1].flip(0), _topk(second, 2)[1].flip(0)
    with routing_mode(Routes([slot], 1, 2), replay=True, recompute=True):
        slot.targets.extend([t1, t2])
        with torch.no_grad():
            slot.get_replay_topk(first, 2, default_compute_topk=_topk)
            slot.get_replay_topk(second, 2, default_compute_topk=_topk)
        w = first.clone().requires_grad_()
        with torch.enable_grad():
            _, used1 = slot.get_replay_topk(w, 2, default_compute_topk=_topk)
            _, used2 = slot.get_replay_topk(second.clone().requires_grad_(), 2, default_compute_topk=_topk)
    assert torch.equal(used1, t1) and torch.equal(used2, t2)


def test_engine_routes_cover_every_position_and_pad_into_micro_batches():
    """vLLM returns routes for the positions it fed ([P + R - 1, layers, k]); the sample's column
    has P + R rows, -1 on the last; a micro-batch pads rows and columns with -1 (router's choice)."""
    layers, k = 3, 2
    prompt, responses = [5, 6, 7], [[8, 9], [10]]
    fed = [torch.randint(0, 8, (len(prompt) + len(r) - 1, layers, k), dtype=torch.int16).numpy() for r in responses]
    group = RolloutGroup("g", 0, prompt, responses, [[-0.1] * len(r) for r in responses], ["stop", "stop"], fed)
    cols = [group.route_positions(i) for i in range(2)]
    assert [c.shape for c in cols] == [(5, layers, k), (4, layers, k)]
    assert torch.equal(cols[0][:4], torch.as_tensor(fed[0])) and (cols[0][4] == -1).all()
    assert RolloutGroup("h", 0, prompt, responses).route_positions(0) is None
    batch = RolloutBatch.from_samples([dict(prompts=prompt, responses=r, routed_experts=c)
                                       for r, c in zip(responses, cols)])
    micro = mb.build_microbatch(batch, [1, 0], rows=3, seq_len=6, width=2)
    assert micro.routed_experts.shape == (3, 6, layers, k) and micro.routed_experts.dtype == torch.int16
    assert torch.equal(micro.routed_experts[0, :4], cols[1]) and (micro.routed_experts[0, 4:] == -1).all()
    assert (micro.routed_experts[2] == -1).all()  # padding row


@pytest.mark.parametrize("n_fed", [0, 9])
def test_engine_routes_of_odd_length_are_padded_or_cut(n_fed):
    group = RolloutGroup("g", 0, [1, 2], [[3, 4]], [[0.0, 0.0]], ["abort"],
                         [torch.zeros(n_fed, 2, 1, dtype=torch.int16).numpy()])
    col = group.route_positions(0)
    assert col.shape == (4, 2, 1) and ((col == -1).all() if n_fed == 0 else (col == 0).all())
