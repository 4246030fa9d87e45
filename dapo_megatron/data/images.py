"""Images of verl-format rows (geo3k): check them, refer to them, and turn the `<image>`
placeholders of the prompt into the structured content that vision-language chat templates render.

A row's `images` is a list of `{bytes, path}` (verl's and HF datasets' Image layout): `bytes`, an
encoded PNG/JPEG, wins; else `path` names a file, a relative one resolved against the data file's
folder (converted datasets keep their images next to the parquet, not next to the trainer's cwd).
Errors are ValueError naming the image index (and the image file): the dataset adds data file and row.

The dataset decodes every image once, to fail on a broken one at load time and to learn its size
(what the prompt's token count needs), and keeps an `ImageRef`: where the image is, not its
pixels. A prompt goes to an engine with its refs; the engine opens them (`open_image`: the image
file, or the bytes in the data file's row), so pixels never pass through the driver. With several
nodes the data files must be readable where the engines run (a shared file system), as the
image files of a path-based data set must.
"""
from __future__ import annotations

import io
import os
import re
from typing import Any

from dataclasses import dataclass
from functools import lru_cache

from PIL import Image

IMAGE_PLACEHOLDER = "<image>"  # where an image sits in the row's message text (verl's convention)
# What Qwen2/2.5/3-VL chat templates write for one {"type": "image"} part; vLLM expands this one
# token to the image's grid. A template that writes none of it cannot show the model an image.
IMAGE_PAD = "<|image_pad|>"

_PLACEHOLDER_SPLIT = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)})")


@dataclass(frozen=True)
class ImageRef:
    """Where one image of a data set is: an image file (`row` -1), or the bytes of `images[index]`
    in row `row` of the parquet file `source`; with its size in pixels (the processor's grid and
    so the prompt's token count follow from it)."""
    source: str
    row: int
    index: int
    width: int
    height: int


def open_image(image: "ImageRef | Image.Image") -> Image.Image:
    """The RGB image a ref points to (an image is returned as it is)."""
    if isinstance(image, Image.Image):
        return image
    if image.row < 0:
        return _load_image(image.source, "", image.index)
    entries = _parquet_images(image.source)[image.row].as_py()
    return _load_image(entries[image.index], "", image.index)


@lru_cache(maxsize=8)
def _parquet_images(path: str):
    """The `images` column of a parquet data file (encoded bytes), read once per process."""
    import pyarrow.parquet as pq
    return pq.read_table(path, columns=["images"]).column("images")


def row_images(row: dict[str, Any], messages: list[dict[str, str]], base_dir: str, data_file: str = "",
               row_index: int = -1) -> tuple[list[dict[str, Any]], tuple[ImageRef, ...]]:
    """(messages for the chat template, refs to its images) of row `row_index` of `data_file`
    (its images decoded once here, to check them). A row without `images` (or with null there, as
    text rows of a mixed parquet file have) is text: (messages, ()) unchanged."""
    entries = row.get("images")
    if entries is None:
        return messages, ()
    if not isinstance(entries, list):
        raise ValueError(f"images must be a list of {{bytes, path}}, got a {type(entries).__name__}")
    chat = split_image_placeholders(messages, len(entries))  # cheap: before decoding anything
    refs = []
    for i, (entry, image) in enumerate(zip(entries, load_images(entries, base_dir))):
        data, path = _image_source(entry, i)
        if data is not None and not data_file.endswith(".parquet"):
            raise ValueError(f"images[{i}] has bytes, which only a parquet data file can hold")
        source = os.path.abspath(data_file) if data is not None else _full_path(path, base_dir)
        refs.append(ImageRef(source, row_index if data is not None else -1, i, image.width, image.height))
    return chat, tuple(refs)


def split_image_placeholders(messages: list[dict[str, str]], n_images: int) -> list[dict[str, Any]]:
    """Messages whose text holds `<image>` get list content, split at the placeholders, order kept:
    "<image>Find x." -> [{"type": "image"}, {"type": "text", "text": "Find x."}]. Other messages
    stay strings. The placeholders must number `n_images`: the i-th one is the i-th image."""
    found = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if found != n_images:
        raise ValueError(f"the prompt has {found} {IMAGE_PLACEHOLDER} placeholder(s) but images has "
                         f"{n_images} entr{'y' if n_images == 1 else 'ies'}; they must match, one per image")
    return [{"role": m["role"], "content": _content_parts(m["content"])} if IMAGE_PLACEHOLDER in m["content"]
            else m for m in messages]


def _content_parts(text: str) -> list[dict[str, str]]:
    parts = [p for p in _PLACEHOLDER_SPLIT.split(text) if p]  # verl drops the empty pieces too
    return [{"type": "image"} if p == IMAGE_PLACEHOLDER else {"type": "text", "text": p} for p in parts]


def load_images(entries: list[Any], base_dir: str) -> tuple[Image.Image, ...]:
    """Decode every image of a row, fully (a truncated file fails here, not in the engine), as RGB,
    the mode the Qwen-VL image processors convert to anyway."""
    return tuple(_load_image(entry, base_dir, i) for i, entry in enumerate(entries))


def _load_image(entry: Any, base_dir: str, index: int) -> Image.Image:
    data, path = _image_source(entry, index)
    if data is not None:
        source, what = io.BytesIO(data), f"images[{index}] ({len(data)} bytes)"
    else:
        full = _full_path(path, base_dir)
        if not os.path.isfile(full):
            raise ValueError(f"images[{index}]: image file {full} not found (path {path!r}; a relative "
                             f"path is resolved against the data file's folder)")
        source, what = full, f"images[{index}] (file {full})"
    try:
        with Image.open(source) as image:
            image.load()
            return image.convert("RGB")
    except Exception as e:  # noqa: BLE001 - PIL raises several types for a corrupt image
        raise ValueError(f"{what}: cannot decode the image: {type(e).__name__}: {e}") from e


def _full_path(path: str, base_dir: str) -> str:
    return path if os.path.isabs(path) else os.path.join(base_dir, path)


def _image_source(entry: Any, index: int) -> tuple[bytes | None, str | None]:
    """(bytes, None) or (None, path) of one `images` entry: {bytes, path}, or a bare path string."""
    if isinstance(entry, str):
        entry = {"path": entry}
    if not isinstance(entry, dict):
        raise ValueError(f"images[{index}] must be {{bytes, path}} or a path, got a {type(entry).__name__}")
    data, path = entry.get("bytes"), entry.get("path")
    if data is not None:
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"images[{index}].bytes must be encoded image bytes, got a {type(data).__name__}")
        return bytes(data), None
    if isinstance(path, str) and path:
        return None, path
    raise ValueError(f"images[{index}] has neither bytes nor a path: {entry!r:.80}")
