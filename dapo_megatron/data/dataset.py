"""Prompt datasets in the verl/DAPO schema, from parquet or JSONL, chat-templated and tokenized once.

A row: {data_source, prompt: [{role, content}, ...], reward_model: {ground_truth, ...},
extra_info: {...}, images?: [{bytes, path}, ...], ...}; other columns are ignored. Prompts longer
than data.max_prompt_length tokens are filtered, truncated or rejected per data.truncation. Every
error names the file and the 0-based row index (for JSONL also the line), so a bad row in a
17k-row file is found in seconds. Paths are files: the caller resolves `tiny://` asset paths first
(`assets.resolve_asset_path`).

Rows with images (geo3k): `images.row_images` checks them and puts refs to them (not pixels) on
`Prompt.images`, and turns the `<image>` placeholders into image parts for the chat template,
which must render each as one `<|image_pad|>` (a vision-language tokenizer; vLLM expands it).
Lengths count the expanded image tokens when the caller gives `image_tokens` (the model's image
processor), else one per image.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pyarrow.parquet as pq

from dapo_megatron.batch import Prompt
from dapo_megatron.config.schema import DataConfig
from dapo_megatron.data.images import IMAGE_PAD, row_images

log = logging.getLogger(__name__)

READERS = (".parquet", ".jsonl")


class DataError(ValueError):
    """A missing or unreadable data file, or a malformed row; the message says which and where."""


@dataclass(frozen=True)
class PromptItem:
    index: int  # position in this dataset: what the sampler hands out
    prompt: Prompt  # ids: chat template applied (with the generation header), maybe truncated
    messages: list[dict[str, str]]  # the row's raw chat messages (with its <image> placeholders)
    ground_truth: str
    data_source: str
    extra_info: dict[str, Any]
    source: str  # "FILE row N", for logs and errors


class PromptDataset:
    """All rows of `files`, concatenated in order; items are PromptItem, `stats` counts what was dropped."""

    def __init__(self, files: list[str], tokenizer, *, prompt_key: str, max_prompt_length: int, truncation: str,
                 skip_bad_rows: bool, config_key: str = "data.train_files", tools: list[dict] | None = None,
                 image_tokens: Callable[[tuple], list[int]] | None = None):
        self.stats = {"files": len(files), "rows": 0, "kept": 0, "bad_rows": 0, "too_long": 0, "truncated": 0}
        self._prompt_key, self._max_len, self._truncation = prompt_key, max_prompt_length, truncation
        self._skip_bad_rows = skip_bad_rows
        self._template_kwargs = {"tools": tools} if tools else {}  # multi-turn: the template lists the tools
        # images -> the tokens each fills once the engine expands its pad (the model's image processor);
        # None: one token per image (no processor known, e.g. tests of the parsing alone).
        self._image_tokens = image_tokens
        if not files:
            raise DataError(f"{config_key} is empty: give at least one .parquet or .jsonl file")
        self.items: list[PromptItem] = []
        for path in files:
            self._load_file(path, tokenizer, config_key)
        self.stats["kept"] = len(self.items)
        log.info("%s: %d rows from %d files, %d kept, %d bad rows skipped, %d longer than "
                 "data.max_prompt_length=%d (%s)", config_key, self.stats["rows"], len(files), len(self.items),
                 self.stats["bad_rows"], self.stats["too_long"] + self.stats["truncated"], max_prompt_length,
                 "filtered" if truncation == "filter" else f"truncation={truncation}")

    @classmethod
    def from_config(cls, cfg: DataConfig, tokenizer, split: str = "train",
                    tools: list[dict] | None = None,
                    image_tokens: Callable[[tuple], list[int]] | None = None) -> "PromptDataset":
        """The train or val dataset of `cfg` (split: "train" | "val"); tools: JSON schemas the
        chat template shows the model (multi-turn rollouts); image_tokens: see __init__."""
        files = {"train": cfg.train_files, "val": cfg.val_files}[split]
        return cls(list(files), tokenizer, prompt_key=cfg.prompt_key, max_prompt_length=cfg.max_prompt_length,
                   truncation=cfg.truncation, skip_bad_rows=cfg.skip_bad_rows, config_key=f"data.{split}_files",
                   tools=tools, image_tokens=image_tokens)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]

    def _load_file(self, path: str, tokenizer, config_key: str) -> None:
        base_dir = os.path.dirname(os.path.abspath(path))  # relative image paths start here
        parsed: list[tuple[str, tuple, tuple]] = []  # (where, (messages, ground_truth, ...), images)
        texts: list[str] = []
        for number, where, row in _read_rows(path, config_key):
            self.stats["rows"] += 1
            try:
                row = json.loads(row) if isinstance(row, str) else row
                fields = parse_row(row, self._prompt_key)
                chat, images = row_images(row, fields[0], base_dir, path, number)
                text = None if images else tokenizer.apply_chat_template(
                    fields[0], add_generation_prompt=True, tokenize=False, **self._template_kwargs)
            except Exception as e:  # noqa: BLE001 - any failure here is this row's fault
                self._bad_row(where, e)
                continue
            if images:
                text = self._render_images(tokenizer, chat, len(images), where)
            parsed.append((where, fields, images))
            texts.append(text)
        # One batched call, which `tokenizers` spreads over threads when TOKENIZERS_PARALLELISM
        # allows. The template already wrote any BOS, so no special tokens are added again.
        all_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        for (where, (messages, ground_truth, data_source, extra_info), images), ids in zip(parsed, all_ids):
            ids = self._fit_length(list(ids), where, self._expanded_extra(images, where))
            if ids is not None:
                self.items.append(PromptItem(len(self.items), Prompt(tuple(ids), images), messages, ground_truth,
                                             data_source, extra_info, where))

    def _render_images(self, tokenizer, chat: list[dict], n_images: int, where: str) -> str:
        """The chat template's text for a row with images. A template that cannot show an image (a
        text-only model's) is the configuration's fault, not the row's: it is raised even with
        data.skip_bad_rows, which would otherwise drop every image row, or train without the images."""
        try:
            text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False,
                                                 **self._template_kwargs)
            problem = "" if text.count(IMAGE_PAD) == n_images else \
                f"it wrote {text.count(IMAGE_PAD)} {IMAGE_PAD} for {n_images} image(s)"
        except Exception as e:  # noqa: BLE001 - a text-only template fails on list content in many ways
            problem = f"{type(e).__name__}: {e}"
        if problem:
            raise DataError(f"{where}: the row has {n_images} image(s), but the chat template of the tokenizer "
                            f"at {getattr(tokenizer, 'name_or_path', '?')} (model.tokenizer_path, else model.path) "
                            f"cannot render images ({problem}); a text-only model cannot take image data: use a "
                            f"vision-language model's tokenizer, or data without an images column")
        return text

    def _bad_row(self, where: str, error: Exception) -> None:
        if not self._skip_bad_rows:
            raise DataError(f"{where}: {error} (set data.skip_bad_rows=true to skip such rows)") from error
        self.stats["bad_rows"] += 1
        log.warning("skipping %s: %s", where, error)

    def _expanded_extra(self, images: tuple, where: str) -> int | None:
        """Tokens the engine adds when it expands the images' pads (None: no images)."""
        if not images:
            return None
        if self._image_tokens is None:
            return 0
        try:
            return sum(n - 1 for n in self._image_tokens(images))
        except Exception as e:  # noqa: BLE001 - the processor refusing an image is that row's fault
            raise DataError(f"{where}: the image processor cannot size its images: {type(e).__name__}: {e}") from e

    def _fit_length(self, ids: list[int], where: str, image_extra: int | None = None) -> list[int] | None:
        """Apply data.truncation to a prompt over max_prompt_length; None means drop it. A prompt with
        images counts them expanded (`image_extra` tokens more) and is dropped rather than cut: a
        cut image pad would leave an image without its place."""
        length = len(ids) + (image_extra or 0)
        if length <= self._max_len:
            return ids
        if self._truncation == "filter" or (image_extra is not None and self._truncation != "error"):
            self.stats["too_long"] += 1
            return None
        if self._truncation == "error":
            expanded = " with its images expanded" if image_extra else ""
            raise DataError(f"{where}: prompt is {length} tokens{expanded}, over data.max_prompt_length="
                            f"{self._max_len} (raise it, or set data.truncation to filter, left or right)")
        self.stats["truncated"] += 1
        # verl's meaning: "left" cuts the left end (keeps the last tokens), "right" the right end.
        return ids[-self._max_len:] if self._truncation == "left" else ids[:self._max_len]


def parse_row(row: Any, prompt_key: str) -> tuple[list[dict[str, str]], str, str, dict[str, Any]]:
    """(messages, ground_truth, data_source, extra_info) of one row; ValueError says what is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"row is a {type(row).__name__}, not an object")
    messages = row.get(prompt_key)
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{prompt_key!r} must be a non-empty list of {{role, content}} messages, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{prompt_key}[{i}] must be a {{role: str, content: str}} message, got {m!r:.80}")
    reward_model = row.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if truth is None or isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        raise ValueError(f"reward_model.ground_truth must be a string (or number), got {truth!r:.80}")
    data_source = row.get("data_source")
    if not isinstance(data_source, str):
        raise ValueError(f"data_source must be a string, got {data_source!r:.80}")
    extra_info = row.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise ValueError(f"extra_info must be an object, got {extra_info!r:.80}")
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    return messages, str(truth), data_source, extra_info


def _read_rows(path: str, config_key: str) -> Iterator[tuple[int, str, Any]]:
    """Yield (N, "FILE row N", row) for each row; JSONL rows come as text, decoded by the caller so
    that a line that is not JSON is a bad row like any other."""
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path} (from {config_key})")
    if path.endswith(".parquet"):
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a corrupt file
            raise DataError(f"cannot read parquet file {path}: {e}") from e
        for i, row in enumerate(rows):
            yield i, f"{path} row {i}", row
    elif path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if line.strip():
                    yield i, f"{path} row {i} (line {i + 1})", line
    else:
        raise DataError(f"unknown data file type: {path} (from {config_key}); use one of {', '.join(READERS)}")
