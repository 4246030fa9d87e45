"""The prompt stream: a seeded shuffle per epoch, batches that cross epoch boundaries, exact resume.

Dynamic sampling asks for prompts in rounds of data.gen_batch_size until enough groups are kept;
with early stop, prompts that were aborted or never started go back with `push_back` and are
served first next time, so no prompt is skipped. `state_dict()` holds everything (including the
pushed-back prompts), so a resumed run sees exactly the batches an uninterrupted one would.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


class PromptSampler:
    def __init__(self, num_items: int, *, shuffle: bool, seed: int):
        if num_items <= 0:
            raise ValueError("the prompt dataset is empty: check data.train_files and the filter counts in the log")
        self.num_items, self.shuffle, self.seed = num_items, shuffle, seed
        self._epoch = 0
        self._position = 0  # next unserved slot of this epoch's order
        self._pushed_back: list[int] = []  # served before the epoch order, front first
        self._order = self._order_of(0)

    @property
    def epoch(self) -> int:
        """Full passes served so far (0 during the first pass); pushed-back prompts do not count."""
        return self._epoch

    @property
    def position(self) -> int:
        """Prompts already served from the current epoch's order."""
        return self._position

    @property
    def consumed(self) -> int:
        """Prompts taken from the stream and not given back: the run's position in its data."""
        return self._epoch * self.num_items + self._position - len(self._pushed_back)

    def next(self, batch_size: int) -> list[int]:
        """The next `batch_size` dataset indices: pushed-back prompts first, then the shuffled stream."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        batch = self._pushed_back[:batch_size]
        del self._pushed_back[:batch_size]
        while len(batch) < batch_size:
            take = min(batch_size - len(batch), self.num_items - self._position)
            batch += self._order[self._position:self._position + take]
            self._position += take
            if self._position == self.num_items:  # roll over eagerly so `epoch` counts finished passes
                self._epoch, self._position = self._epoch + 1, 0
                self._order = self._order_of(self._epoch)
        return batch

    def push_back(self, indices: list[int]) -> None:
        """Put unused prompts back at the front of the stream, in the given order.

        A later push goes in front of an earlier one that has not been served yet.
        """
        bad = [i for i in indices if not 0 <= i < self.num_items]
        if bad:
            raise ValueError(f"push_back got indices outside [0, {self.num_items}): {bad[:10]}")
        self._pushed_back[:0] = [int(i) for i in indices]

    def state_dict(self) -> dict[str, Any]:
        return {"num_items": self.num_items, "shuffle": self.shuffle, "seed": self.seed, "epoch": self._epoch,
                "position": self._position, "pushed_back": list(self._pushed_back)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by state_dict(); the saved seed and shuffle win (exact resume)."""
        if state["num_items"] != self.num_items:
            raise ValueError(f"sampler state is for {state['num_items']} prompts but the dataset has "
                             f"{self.num_items}: did data.train_files, data.max_prompt_length or "
                             f"data.truncation change since the checkpoint?")
        if (state["seed"], state["shuffle"]) != (self.seed, self.shuffle):
            log.warning("resuming the prompt order of the checkpoint (data.seed=%s, data.shuffle=%s), not the "
                        "configured data.seed=%s, data.shuffle=%s", state["seed"], state["shuffle"], self.seed,
                        self.shuffle)
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self._epoch, self._position = state["epoch"], state["position"]
        self._pushed_back = list(state["pushed_back"])
        self._order = self._order_of(self._epoch)

    def _order_of(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_items))
        # (seed, epoch) as a seed sequence: unlike seed + epoch, seed 1 epoch 0 and seed 0 epoch 1
        # do not share an order. The order is recomputed on resume, so it relies on numpy giving
        # the same permutation for a seed (true in practice, not promised across major versions).
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_items).tolist()
