"""Rows with images (verl's geo3k schema): decoding bytes and paths, placeholders -> image parts,
errors that name the file, row and image index, and text-only tokenizers refusing image data."""
from __future__ import annotations

import io
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from transformers import AutoTokenizer

from dapo_megatron.data import synthetic
from dapo_megatron.data.dataset import DataError, PromptDataset
from dapo_megatron.data.images import IMAGE_PAD, ImageRef, load_images, open_image, split_image_placeholders

RED, BLUE = (220, 30, 30), (30, 30, 220)


def encoded(colour, fmt="PNG", size=(28, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format=fmt)
    return buf.getvalue()


def noisy_png_cut_in_half() -> bytes:
    """A PNG whose header reads fine (PIL opens it lazily) but whose pixels stop halfway."""
    buf = io.BytesIO()
    Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48).save(buf, format="PNG")
    return buf.getvalue()[:len(buf.getvalue()) // 2]


def geo_row(content: str, images: list, answer: str = "60") -> dict:
    return {"data_source": "hiyouga/geometry3k", "prompt": [{"role": "user", "content": content}],
            "images": images, "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"index": 0}}


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def load(files, tokenizer, *, max_prompt_length=256, truncation="filter", skip_bad_rows=False):
    return PromptDataset([str(f) for f in files], tokenizer, prompt_key="prompt", max_prompt_length=max_prompt_length,
                         truncation=truncation, skip_bad_rows=skip_bad_rows)


@pytest.fixture(scope="module")
def text_tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets / "tokenizer")


def test_split_image_placeholders_keeps_order_and_plain_messages():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Compare <image> with<image>: which is red?"}]
    assert split_image_placeholders(messages, 2) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                     {"type": "text", "text": " with"}, {"type": "image"},
                                     {"type": "text", "text": ": which is red?"}]}]
    assert split_image_placeholders([{"role": "user", "content": "<image>"}], 1) == [
        {"role": "user", "content": [{"type": "image"}]}]
    with pytest.raises(ValueError, match="2 <image> placeholder.* images has 3 entries"):
        split_image_placeholders(messages, 3)


def test_bytes_and_path_images_decode(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "blue.png").write_bytes(encoded(BLUE))
    entries = [{"bytes": encoded(RED), "path": None}, {"bytes": encoded(BLUE, "JPEG"), "path": "ignored.png"},
               {"bytes": None, "path": "img/blue.png"}, {"path": str(tmp_path / "img" / "blue.png")},
               "img/blue.png"]
    images = load_images(entries, str(tmp_path))
    assert [im.size for im in images] == [(28, 56)] * 5 and {im.mode for im in images} == {"RGB"}
    assert images[0].getpixel((3, 3)) == RED
    assert all(abs(a - b) <= 8 for a, b in zip(images[1].getpixel((3, 3)), BLUE))  # JPEG is lossy
    assert images[2].getpixel((3, 3)) == images[3].getpixel((3, 3)) == images[4].getpixel((3, 3)) == BLUE


def test_image_rows_load_onto_the_prompt(vl_tokenizer, tmp_path, monkeypatch):
    data = tmp_path / "geo3k"
    (data / "img").mkdir(parents=True)
    (data / "img" / "b.png").write_bytes(encoded(BLUE))
    rows = [geo_row("<image>Find x.", [{"bytes": encoded(RED), "path": None}], "60"),
            geo_row("<image> and <image>: which is blue?", [{"bytes": encoded(RED), "path": None},
                                                            {"bytes": None, "path": "img/b.png"}], "2")]
    path = write_parquet(data / "train.parquet", rows)
    monkeypatch.chdir(tmp_path)  # relative image paths follow the data file, not the cwd
    ds = load([path], vl_tokenizer)
    assert len(ds) == 2 and ds.stats["bad_rows"] == 0
    first, second = ds[0], ds[1]
    # Refs, not pixels: the bytes stay in the data file's row, a path stays a path.
    assert second.prompt.images == (ImageRef(str(path), 1, 0, 28, 56), ImageRef(str(data / "img" / "b.png"), -1, 1, 28, 56))
    assert [open_image(im).getpixel((0, 0)) for im in first.prompt.images] == [RED]
    assert [open_image(im).getpixel((0, 0)) for im in second.prompt.images] == [RED, BLUE]
    pad = vl_tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert first.prompt.ids.count(pad) == 1 and second.prompt.ids.count(pad) == 2  # one per image
    assert vl_tokenizer.decode(second.prompt.ids) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|> and <|vision_start|><|image_pad|><|vision_end|>: "
        "which is blue?<|im_end|>\n<|im_start|>assistant\n")
    assert first.messages == rows[0]["prompt"] and first.ground_truth == "60"  # the raw row's messages
    jsonl = tmp_path / "rows.jsonl"  # JSONL carries paths (bytes have no JSON form)
    jsonl.write_text(json.dumps(geo_row("<image>Find x.", [{"path": str(data / "img" / "b.png")}])) + "\n")
    (item,) = load([jsonl], vl_tokenizer)
    assert open_image(item.prompt.images[0]).getpixel((0, 0)) == BLUE


BROKEN = [  # (row, what the error says after "FILE row 1: ")
    (geo_row("<image><image>", [{"bytes": encoded(RED), "path": None},
                                 {"bytes": noisy_png_cut_in_half(), "path": None}]),
     r"images\[1\] \(\d+ bytes\): cannot decode the image: OSError: image file is truncated"),
    (geo_row("<image>", [{"bytes": b"not an image at all", "path": None}]),
     r"images\[0\] \(19 bytes\): cannot decode the image: UnidentifiedImageError"),
    (geo_row("<image>", [{"bytes": None, "path": "img/missing.png"}]),
     r"images\[0\]: image file .*geo3k/img/missing\.png not found \(path 'img/missing\.png'"),
    (geo_row("<image>", [{"bytes": None, "path": None}]), r"images\[0\] has neither bytes nor a path"),
    (geo_row("<image> twice <image>", [{"bytes": encoded(RED), "path": None}]),
     r"the prompt has 2 <image> placeholder\(s\) but images has 1 entry"),
    (geo_row("no placeholder", [{"bytes": encoded(RED), "path": None}]),
     r"the prompt has 0 <image> placeholder\(s\) but images has 1 entry"),
]


@pytest.mark.parametrize("bad,reason", BROKEN)
def test_bad_image_names_file_row_and_image(vl_tokenizer, tmp_path, bad, reason):
    good = geo_row("<image>Find x.", [{"bytes": encoded(BLUE), "path": None}])
    path = write_parquet(tmp_path / "geo3k" / "bad.parquet", [good, bad, good])
    with pytest.raises(DataError, match=rf"bad\.parquet row 1: {reason}.*skip_bad_rows"):
        load([path], vl_tokenizer)


def test_skip_bad_rows_counts_bad_images(vl_tokenizer, tmp_path):
    good = geo_row("<image>Find x.", [{"bytes": encoded(BLUE), "path": None}])
    path = write_parquet(tmp_path / "geo3k" / "bad.parquet", [good] + [bad for bad, _ in BROKEN] + [good])
    ds = load([path], vl_tokenizer, skip_bad_rows=True)
    assert len(ds) == 2 and ds.stats["bad_rows"] == len(BROKEN) and ds.stats["rows"] == len(BROKEN) + 2
    assert ds[1].source.endswith(f"bad.parquet row {len(BROKEN) + 1}") and len(ds[1].prompt.images) == 1


def test_text_rows_are_unchanged(text_tokenizer, tmp_path):
    """A null `images` (text rows of a mixed file) or an empty list is a text row: same ids, no images."""
    text_rows = [synthetic.make_row(3, 4, 0, "train"), synthetic.make_row(5, 1, 1, "train")]
    plain = write_parquet(tmp_path / "plain.parquet", text_rows)
    with_column = write_parquet(tmp_path / "column.parquet", [dict(text_rows[0], images=None),
                                                             dict(text_rows[1], images=[])])
    before, after = load([plain], text_tokenizer), load([with_column], text_tokenizer)
    assert [it.prompt for it in after] == [it.prompt for it in before] and len(before) == 2
    assert all(it.prompt.images == () for it in after)
    assert [it.messages for it in after] == [r["prompt"] for r in text_rows]


def test_text_only_tokenizer_refuses_image_rows(text_tokenizer, tmp_path):
    path = write_parquet(tmp_path / "geo3k" / "train.parquet",
                         [synthetic.make_row(1, 2, 0, "train") | {"images": None},
                          geo_row("<image>Find x.", [{"bytes": encoded(RED), "path": None}])])
    tokenizer_dir = str(text_tokenizer.name_or_path)
    for skip in (False, True):  # a configuration error: skipping would drop every image row
        with pytest.raises(DataError, match=r"train\.parquet row 1: the row has 1 image\(s\), but the chat template "
                                            rf"of the tokenizer at {re.escape(tokenizer_dir)} \(model\.tokenizer_path.*"
                                            r"cannot render images \(TypeError.*text-only model"):
            load([path], text_tokenizer, skip_bad_rows=skip)
    # A template that takes list content but writes only the text would silently drop the image.
    drops_images = AutoTokenizer.from_pretrained(tokenizer_dir)
    drops_images.chat_template = ("{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'text' %}"
                                  "{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}")
    only_images = write_parquet(tmp_path / "only.parquet",
                                [geo_row("<image>Find x.", [{"bytes": encoded(RED), "path": None}])])
    with pytest.raises(DataError, match=r"only\.parquet row 0: .*cannot render images \(it wrote 0 "
                                        r"<\|image_pad\|> for 1 image"):
        load([only_images], drops_images)


def test_long_image_rows_are_dropped_not_cut(vl_tokenizer, tmp_path):
    path = write_parquet(tmp_path / "geo3k" / "long.parquet",
                         [geo_row("<image>" + "Find x. " * 30, [{"bytes": encoded(RED), "path": None}]),
                          geo_row("<image>Find x.", [{"bytes": encoded(RED), "path": None}])])
    for truncation in ("left", "right", "filter"):
        ds = load([path], vl_tokenizer, max_prompt_length=40, truncation=truncation)
        assert len(ds) == 1 and ds.stats["too_long"] == 1 and ds.stats["truncated"] == 0
        assert ds[0].source.endswith("row 1") and len(ds[0].prompt.images) == 1
    with pytest.raises(DataError, match=r"long\.parquet row 0: prompt is \d+ tokens"):
        load([path], vl_tokenizer, max_prompt_length=40, truncation="error")


def test_image_rows_are_counted_with_their_images_expanded(vl_tokenizer, tmp_path):
    """With the model's counter (here: 30 tokens per image) a prompt that fits with one pad per
    image is over data.max_prompt_length once its image is expanded: dropped, or named by `error`."""
    path = write_parquet(tmp_path / "geo3k" / "expand.parquet",
                         [geo_row("<image>Find x.", [{"bytes": encoded(RED), "path": None}])])
    short = len(load([path], vl_tokenizer)[0].prompt)
    limit = short + 10  # room for 10 more tokens: not for an image of 30
    assert len(load([path], vl_tokenizer, max_prompt_length=limit)) == 1  # one token per image
    counted = PromptDataset([str(path)], vl_tokenizer, prompt_key="prompt", max_prompt_length=limit,
                            truncation="left", skip_bad_rows=False, image_tokens=lambda images: [30] * len(images))
    assert len(counted) == 0 and counted.stats["too_long"] == 1
    roomy = PromptDataset([str(path)], vl_tokenizer, prompt_key="prompt", max_prompt_length=short + 29,
                          truncation="error", skip_bad_rows=False, image_tokens=lambda images: [30] * len(images))
    assert len(roomy) == 1 and roomy[0].prompt.ids == load([path], vl_tokenizer)[0].prompt.ids  # ids unexpanded
    with pytest.raises(DataError, match=rf"expand\.parquet row 0: prompt is {short + 29} tokens with its images "
                                        rf"expanded, over data.max_prompt_length={short + 28}"):
        PromptDataset([str(path)], vl_tokenizer, prompt_key="prompt", max_prompt_length=short + 28,
                      truncation="error", skip_bad_rows=False, image_tokens=lambda images: [30] * len(images))
