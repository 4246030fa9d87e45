"""The reward role in the rollout manager's process: responses from the data plane, scores back.

It was a Ray actor of its own: a process importing torch and transformers (~0.4 GB PSS on the
quickstart) to front a pool whose workers do the scoring, and a round trip per scored batch.
Its caller, the manager, is the only one who asks; the pool (reward/manager.py) keeps the
math-verify work, its deadlines and crashes out of the manager's process.
"""
from __future__ import annotations

from dapo_megatron import dataplane
from dapo_megatron.batch import READ_BY_REWARD, read_by
from dapo_megatron.config.schema import DapoConfig


class RewardWorker:
    """The reward role: reads the responses of scored groups from the data plane, scores them
    with the reward manager (its worker pool or service, deadlines and overlong shaping) and
    returns `scores` / `acc` (a float and a bool per response: StepBatch metadata, batch.FIELDS)
    with its metrics."""

    def __init__(self, cfg: DapoConfig, tokenizer_path: str, data_plane: dataplane.Handle):
        from transformers import AutoTokenizer

        from dapo_megatron.reward.manager import RewardManager
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
