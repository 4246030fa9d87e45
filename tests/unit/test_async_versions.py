"""The policy-version record of trainer.mode=async: the engine's bookkeeping splits a response
where a weight push reached it (`Requests.new_version`), and the driver's staleness check reads
those records (`driver.metrics.staleness`). No vLLM engine: real vLLM RequestOutputs, fed by hand."""
from __future__ import annotations

import queue

import pytest

from dapo_megatron.rollout.types import RolloutGroup, Sampling


def _output(child, tokens, finish=None):
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput
    lps = [{t: Logprob(-0.5)} for t in tokens]
    return RequestOutput(child, None, [1, 2], None, [CompletionOutput(0, "", tokens, None, lps, None, finish)],
                         finish is not None)


def test_a_push_splits_the_unfinished_responses_only():
    from dapo_megatron.batch import Prompt
    from dapo_megatron.rollout.requests import Requests
    added = []
    engine = Requests(lambda *a: added.append(a[0]), lambda ids: None)
    engine.new_version(3)  # the engine holds policy 3 when the group arrives
    sink = queue.Queue()
    engine.add("g", Prompt((1, 2)), Sampling(n=3), 0, sink)
    assert added == ["g#0", "g#1", "g#2"]
    engine.route([_output("g#0", [5, 6]), _output("g#1", [7], "stop"), _output("g#2", [9])])
    engine.new_version(4)  # child 1 finished: it keeps one version
    engine.new_version(5)  # no token sampled by 4: its span goes
    engine.route([_output("g#0", [8], "length"), _output("g#2", [4, 4], "stop")])
    done: RolloutGroup = sink.get_nowait()
    assert done.version_spans == [[(3, 0), (5, 2)], [(3, 0)], [(3, 0), (5, 1)]]
    stored = done.stored("p", ["k0", "k1", "k2"])
    assert [stored.versions(j) for j in range(3)] == [(3, 5), (3, 3), (3, 5)]
    done.version_spans = [[(3, 0)]] * 3  # one version for the whole group: the manager gets one int
    stored = done.stored("p", ["k0", "k1", "k2"])
    assert (stored.version, stored.version_spans, stored.versions(2)) == (3, [], (3, 3))
    assert done.oldest_version == stored.oldest_version == 3
    # the staleness bound reads the oldest token of any response, not the first response's
    done.version_spans = [[(5, 0)], [(4, 0), (5, 3)], [(6, 0)]]
    assert done.oldest_version == done.stored("p", ["k0", "k1", "k2"]).oldest_version == 4


def test_a_push_before_the_first_token_leaves_one_version():
    from dapo_megatron.batch import Prompt
    from dapo_megatron.rollout.requests import Requests
    engine = Requests(lambda *a: None, lambda ids: None)
    sink = queue.Queue()
    engine.add("g", Prompt((1,)), Sampling(n=1), 0, sink)
    engine.new_version(1)
    engine.route([_output("g#0", [5], "stop")])
    assert sink.get_nowait().version_spans == [[(1, 0)]]


def test_staleness_from_the_recorded_versions():
    from dapo_megatron.driver.metrics import staleness
    got = staleness([(3, 3), (2, 3), (1, 2), (3, 3)], syncs=3, bound=2)
    assert got == {"rollout/staleness_mean": 0.75, "rollout/staleness_max": 2.0, "rollout/partial_frac": 0.5,
                   "rollout/stale_share": 0.5}  # two of four lag at all
    assert staleness([(3, 3), (2, 3), (1, 2), (3, 3)], syncs=3, bound=2, share=0.5)["rollout/stale_share"] == 0.5
    with pytest.raises(RuntimeError, match=r"0.500 of the batch's responses .*trainer.stale_share=0.25"):
        staleness([(3, 3), (2, 3), (1, 2), (3, 3)], syncs=3, bound=2, share=0.25)
    with pytest.raises(RuntimeError, match=r"policy lag 3 .*trainer.batches_ahead=2"):
        staleness([(0, 1), (3, 3)], syncs=3, bound=2)
    with pytest.raises(RuntimeError, match="outside"):  # a version the trainer has not pushed yet
        staleness([(4, 4)], syncs=3, bound=2)


@pytest.mark.parametrize("mode,staleness,ahead", [("sync", 1, 0), ("one_step_off", 1, 1), ("async", 3, 3)])
def test_batches_ahead(mode, staleness, ahead):
    from dapo_megatron.config.schema import TrainerConfig
    assert TrainerConfig(mode=mode, max_staleness=staleness).batches_ahead == ahead
