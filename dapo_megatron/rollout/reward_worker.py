"""The reward role in the rollout manager's process: responses from the data plane, scores back;
`RewardScorer`, the collections' score function over it.

It was a Ray actor of its own: a process importing torch and transformers (~0.4 GB PSS on the
quickstart) to front a pool whose workers do the scoring, and a round trip per scored batch.
Its caller, the manager, is the only one who asks; the pool (reward/manager.py) keeps the
math-verify work, its deadlines and crashes out of the manager's process.
"""
from __future__ import annotations

from typing import Sequence

import torch

from dapo_megatron import dataplane
from dapo_megatron.algo import Group
from dapo_megatron.batch import READ_BY_REWARD, read_by
from dapo_megatron.config.schema import DapoConfig
from dapo_megatron.data.dataset import PromptItem
from dapo_megatron.reward.manager import RewardManager
from dapo_megatron.rollout.collection.base import ScoredGroup
from dapo_megatron.rollout.types import StoredGroup


class RewardWorker:
    """The reward role: reads the responses of scored groups from the data plane, scores them
    with the reward manager (its worker pool or service, deadlines and overlong shaping) and
    returns `scores` / `acc` (a float and a bool per response: StepBatch metadata, batch.FIELDS)
    with its metrics."""

    def __init__(self, cfg: DapoConfig, tokenizer_path: str, data_plane: dataplane.Handle):
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.reward = RewardManager(cfg.reward, cfg.data.max_response_length)
        self.plane = dataplane.connect(data_plane)

    def score(self, partition: str, keys: list[str], ground_truths: list[str], data_sources: list[str],
              extra_infos: list[dict], answers: bool = False) -> tuple:
        """(scores, acc, metrics), and with `answers` the extracted answers (maj@k of validation)."""
        responses = [r["responses"].tolist() for r in self.plane.get(partition, keys, list(read_by(READ_BY_REWARD)))]
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        out = self.reward(texts, ground_truths, [len(r) for r in responses], data_sources=data_sources,
                          extra_infos=extra_infos)
        reply = (out.score.tolist(), out.acc.tolist(), out.metrics)
        return (*reply, list(out.pred)) if answers else reply

    def close(self) -> None:
        self.reward.close()


class RewardScorer:
    """ScoreFn (rollout/collection/) over the reward worker, in the manager's process: it
    reads the groups' responses from the data plane and scores them; the manager gets a score and
    an acc per response.

    The filter metric is `algorithm.filter_groups.metric`: `acc` uses correctness, the others the
    shaped score. Reward metrics of all calls in a step are averaged by `pop_metrics()`.
    """

    def __init__(self, reward, metric: str, answers: bool = False):
        self.reward, self.metric, self.answers = reward, metric, answers
        self._metrics: list[dict] = []
        self._sums = [0.0, 0.0, 0]  # score, acc, responses: the sampled reward before filtering

    def __call__(self, items: Sequence[PromptItem], groups: Sequence[StoredGroup]) -> list[Group]:
        per_response = [it for it, g in zip(items, groups) for _ in g.keys]
        keys = [k for g in groups for k in g.keys]
        partitions = {g.partition for g in groups}
        if len(partitions) != 1:
            raise ValueError(f"groups of one score call come from one partition, got {sorted(partitions)}")
        reply = self.reward.score(partitions.pop(), keys, [it.ground_truth for it in per_response],
                                  [it.data_source for it in per_response], [it.extra_info for it in per_response],
                                  self.answers)
        scores, acc, metrics = torch.tensor(reply[0], dtype=torch.float32), torch.tensor(reply[1]), reply[2]
        self._metrics.append(metrics)
        self._sums = [self._sums[0] + scores.sum().item(), self._sums[1] + acc.sum().item(),
                      self._sums[2] + len(keys)]
        out, start = [], 0
        for item, group in zip(items, groups):
            sl = slice(start, start + len(group.keys))
            start = sl.stop
            values = acc[sl].float() if self.metric == "acc" else scores[sl]
            answers = reply[3][sl] if self.answers else []
            out.append(Group(values.tolist(), ScoredGroup(item, group, scores[sl], acc[sl], answers)))
        return out

    def pop_metrics(self) -> dict[str, float]:
        """Reward metrics of the step: `reward/mean`, `acc/mean` over every scored response (the
        sampled reward, before dynamic sampling), and the reward manager's metrics averaged."""
        rows, self._metrics = self._metrics, []
        (score, acc, count), self._sums = self._sums, [0.0, 0.0, 0]
        keys = {k for r in rows for k in r}
        out = {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys}
        if count:
            out.update({"reward/mean": score / count, "acc/mean": acc / count})
        return out
