"""Request bookkeeping of an engine: a prompt fans out to n child requests, their outputs stream
into the prompt's group, and the group goes to its sink once every child finished or was aborted.

What a feature adds (images, routed experts, tool turns) is a `Feature` whose hooks this
bookkeeping calls at fixed points; it never branches on a feature itself. Everything here runs on
the engine's loop thread; vLLM is reached through the two callables the engine passes in.
"""
from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from dapo_megatron.batch import Prompt
from dapo_megatron.rollout.types import RolloutGroup, Sampling


@dataclass
class _Live:
    """One group in flight. children[i]: child i's vLLM request now (None while a feature holds
    it between two requests, e.g. its tools run); inputs: more TokensPrompt fields of every
    child request (images); state: the features' own per-group records; done: finished children."""
    group: RolloutGroup
    sink: queue.Queue
    children: list[Optional[str]]
    sampling: Sampling
    inputs: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)
    done: set = field(default_factory=set)
    max_tokens: Optional[int] = None  # the first requests' budget, where a feature bounds it (None: sampling's)


class Feature:
    """A request feature: hooks called on the loop thread, each doing nothing unless overridden."""

    def on_add(self, live: _Live, prompt: Prompt) -> None:
        """A group is about to be submitted: set up its fields; raise ValueError to refuse it."""

    def on_output(self, live: _Live, i: int, out, logprobs: list[float]) -> None:
        """Child i's new tokens (a vLLM RequestOutput delta), already added to the group's lists."""

    def on_finish(self, live: _Live, i: int, completion) -> bool:
        """Child i's request ended (a vLLM CompletionOutput). True: this feature goes on with the
        child (a later request, `Requests.submit_child`); False: the child is done."""
        return False

    def on_done(self, live: _Live, i: int) -> None:
        """Child i is done (finished or aborted): write what the feature kept into the group."""

    def on_version(self, version: int) -> None:
        """The weights changed (policy `version`), the groups' version spans already updated."""

    def close(self) -> None:
        """The engine shuts down."""


# add_request(request_id, prompt ids, inputs, sampling, child index, max_tokens or None)
AddRequest = Callable[[str, list[int], dict, Sampling, int, Optional[int]], None]


class Requests:
    """The groups in flight. add_request / abort_requests: the engine's vLLM calls; features:
    name -> Feature, its hooks called in this order."""

    def __init__(self, add_request: AddRequest, abort_requests: Callable[[list[str]], None],
                 features: Optional[dict[str, Feature]] = None):
        self._add_request, self._abort_requests = add_request, abort_requests
        self.features: dict[str, Feature] = dict(features or {})
        self.live: dict[str, _Live] = {}  # group request_id -> bookkeeping
        self.child_to_group: dict[str, tuple[str, int]] = {}  # vLLM request id -> (group id, i)
        self.version = 0  # the policy version of the weights the engine holds (`new_version`)

    def add(self, request_id: str, prompt: Prompt, sampling: Sampling, index: int, sink: queue.Queue) -> None:
        """Fan a prompt out to n child requests `<request_id>#<i>`."""
        if request_id in self.live:
            raise ValueError(f"request {request_id!r} is already in flight")
        ids, n = list(prompt.ids), sampling.n
        group = RolloutGroup(request_id, index, ids, [[] for _ in range(n)], [[] for _ in range(n)], [""] * n,
                             version_spans=[[(self.version, 0)] for _ in range(n)])
        live = _Live(group, sink, [f"{request_id}#{i}" for i in range(n)], sampling)
        for f in self.features.values():
            f.on_add(live, prompt)
        self.live[request_id] = live
        for i, child in enumerate(live.children):
            self.submit_child(live, i, child, ids, live.max_tokens)

    def new_version(self, version: int) -> None:
        """The weights changed between two engine steps: the tokens each unfinished response gets
        from now on are sampled by policy `version` (a partial rollout across a weight push)."""
        self.version = version
        for live in self.live.values():
            for i, spans in enumerate(live.group.version_spans):
                if i in live.done:
                    continue
                start = len(live.group.responses[i])
                if spans[-1][1] == start:  # no token sampled under the previous version
                    spans.pop()
                if not spans or spans[-1][0] != version:
                    spans.append((version, start))
        for f in self.features.values():
            f.on_version(version)

    def generating(self) -> int:
        """Responses with a vLLM request running (not finished, not held by a feature)."""
        return sum(c is not None and i not in live.done for live in self.live.values()
                   for i, c in enumerate(live.children))

    def submit_child(self, live: _Live, i: int, request_id: str, ids: list[int],
                     max_tokens: Optional[int] = None) -> None:
        """Child i's next vLLM request (its first, or a feature's continuation)."""
        live.children[i] = request_id
        self.child_to_group[request_id] = (live.group.request_id, i)
        self._add_request(request_id, ids, live.inputs, live.sampling, i, max_tokens)

    def route(self, outputs) -> None:
        """One engine step's RequestOutputs (deltas) into their groups."""
        for out in outputs:
            group_id, i = self.child_to_group.get(out.request_id, (None, -1))
            if group_id is None:
                continue  # aborted meanwhile
            live, c = self.live[group_id], out.outputs[0]
            logprobs = [lp[tok].logprob for tok, lp in zip(c.token_ids, c.logprobs)]
            live.group.responses[i].extend(c.token_ids)
            live.group.rollout_logprobs[i].extend(logprobs)
            for f in self.features.values():
                f.on_output(live, i, out, logprobs)
            if out.finished:
                self.child_to_group.pop(out.request_id, None)
                live.group.finish_reasons[i] = str(c.finish_reason)
                # every feature sees the end (a list, not any(): no short cut)
                if not any([f.on_finish(live, i, c) for f in self.features.values()]):
                    self.finish_child(live, i)

    def finish_child(self, live: _Live, i: int) -> None:
        live.done.add(i)
        for f in self.features.values():
            f.on_done(live, i)
        if len(live.done) == len(live.children):
            del self.live[live.group.request_id]
            live.sink.put(live.group)

    def abort(self, group_ids: Iterable[str]) -> list[str]:
        """Abort the groups in flight among group_ids: their unfinished children end with "abort"
        and the tokens so far (one waiting on a feature ends too); returns the ids aborted."""
        group_ids = [g for g in group_ids if g in self.live]
        for group_id in group_ids:
            live = self.live[group_id]
            pending = [i for i in range(len(live.children)) if i not in live.done]
            self._abort_requests([live.children[i] for i in pending if live.children[i] is not None])
            for i in pending:
                self.child_to_group.pop(live.children[i], None)
                live.group.finish_reasons[i] = "abort"
                self.finish_child(live, i)
        return group_ids

    def close(self) -> None:
        for f in self.features.values():
            f.close()
