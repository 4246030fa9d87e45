"""The geo3k-format generator: answers checked against each figure's own description and pixels,
determinism, and a round trip through the dataset's image parsing."""
from __future__ import annotations

import io
import math
import re
from collections import defaultdict

import pyarrow.parquet as pq
import pytest
from PIL import Image

from dapo_megatron.data import geo3k_synth as g
from dapo_megatron.data.dataset import PromptDataset
from dapo_megatron.data.images import open_image
from dapo_megatron.reward.geo3k import DATA_SOURCE as REWARD_SOURCE

SCENES = [g.make_scene(0, "train", i) for i in range(45)]  # 15 of each kind


def of_kind(kind):
    return [s for s in SCENES if s.kind == kind]


def test_rows_round_trip_through_the_dataset(vl_tokenizer, tmp_path):
    train, test = g.write_geo3k(tmp_path / "geo3k", n_train=6, n_val=3, seed=0)
    assert (train.name, test.name) == ("train.parquet", "test.parquet")
    assert pq.read_schema(train).equals(g.SCHEMA)
    ds = PromptDataset([str(train)], vl_tokenizer, prompt_key="prompt", max_prompt_length=256,
                       truncation="error", skip_bad_rows=False)
    assert len(ds) == 6 and ds.stats["bad_rows"] == 0
    for i, item in enumerate(ds):
        scene = g.make_scene(0, "train", i)
        (image,) = [open_image(im) for im in item.prompt.images]
        assert image.size == (g.SIZE, g.SIZE) and image.tobytes() == g.render(scene).tobytes()
        assert item.ground_truth == str(scene.answer) and item.data_source == REWARD_SOURCE
        assert item.extra_info == {"split": "train", "index": i, "kind": scene.kind}
        (message,) = item.messages
        assert message == {"role": "user", "content": f"<image>{scene.question} {g.INSTRUCTION}"}
    assert [r["extra_info"]["split"] for r in pq.read_table(test).to_pylist()] == ["test"] * 3


def test_same_seed_same_files_other_seed_other_files(tmp_path):
    a = g.write_geo3k(tmp_path / "a", 6, 3, seed=7)
    b = g.write_geo3k(tmp_path / "b", 6, 3, seed=7)
    c = g.write_geo3k(tmp_path / "c", 6, 3, seed=8)
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    assert a[0].read_bytes() != c[0].read_bytes() and a[1].read_bytes() != c[1].read_bytes()
    train, test = ({r["images"][0]["bytes"] for r in pq.read_table(p).to_pylist()} for p in a)
    assert len(train) == 6 and len(test) == 3 and not train & test  # no figure in both splits


def test_answers_vary_and_the_text_does_not_give_them():
    assert {s.kind for s in SCENES} == set(g.SCENES)
    for kind in g.SCENES:
        assert len({s.answer for s in of_kind(kind)}) >= 4, kind
    # Same question, different answers: only the picture tells them apart.
    by_question = defaultdict(set)
    for s in SCENES:
        by_question[s.question].add(s.answer)
        assert not re.search(r"\d", s.question), s.question  # no number in the text at all
    assert max(len(answers) for answers in by_question.values()) >= 4


def test_count_answers_match_the_shapes_drawn():
    asked = set()
    for scene in of_kind("count"):
        (kind,) = {s.kind for s in scene.shapes}  # one kind a figure, the one the question names
        assert scene.question == f"How many {kind}s are in the figure?"
        asked.add(kind)
        assert scene.answer == len(scene.shapes) and 1 <= scene.answer <= g.GRID ** 2
        image = g.render(scene)
        for s in scene.shapes:  # each shape is where the description says, in its colour
            x0, y0, x1, y1 = s.box
            assert image.getpixel(((x0 + x1) // 2, (y0 + y1) // 2)) == g.COLOURS[s.colour]
        boxes = [s.box for s in scene.shapes]
        assert all(a[2] < b[0] or b[2] < a[0] or a[3] < b[1] or b[3] < a[1]
                   for i, a in enumerate(boxes) for b in boxes[i + 1:])  # no overlaps
    assert asked == set(g.SHAPE_KINDS)


def test_kinds_choose_the_problems_and_an_unknown_kind_is_named(tmp_path, capsys):
    rows = g.make_rows(5, seed=0, split="train", size=160, kinds=("count",))
    assert [r["extra_info"]["kind"] for r in rows] == ["count"] * 5
    # Row i of a count-only set is the same figure as row i of any other count-only set.
    assert rows[3]["images"] == g.make_rows(4, seed=0, split="train", size=160, kinds=("count",))[3]["images"]
    both = [g.make_scene(0, "val", i, kinds=("segments", "angle")).kind for i in range(4)]
    assert both == ["segments", "angle", "segments", "angle"]
    with pytest.raises(ValueError, match=r"\['circle'\].*choose among"):
        g.make_scene(0, "train", 0, kinds=("count", "circle"))
    with pytest.raises(SystemExit) as exit_info:
        g.main([str(tmp_path / "out"), "--kinds", "count,angels"])
    assert exit_info.value.code == 2 and "--kinds 'count,angels'" in capsys.readouterr().err
    g.main([str(tmp_path / "out"), "--train", "3", "--val", "2", "--kinds", "angle"])
    assert {r["extra_info"]["kind"] for r in pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()} == {"angle"}


def test_angle_answers_match_the_triangle_drawn():
    for scene in of_kind("angle"):
        assert scene.answer + sum(scene.given) == 180
        assert sorted(label.text for label in scene.labels) == sorted([f"{a}°" for a in scene.given] + ["x"])
        vertices = [start for start, _ in scene.lines]
        for label in scene.labels:  # each label is next to a vertex whose drawn angle is its value
            vertex = min(range(3), key=lambda i: math.dist(vertices[i], label.xy))
            value = scene.answer if label.text == "x" else int(label.text.rstrip("°"))
            assert _angle_at(vertices, vertex) == pytest.approx(value, abs=0.01)
            assert all(0 <= c <= g.SIZE for c in label.xy)  # inside the picture


def _angle_at(vertices, i) -> float:
    (ax, ay), (bx, by), (cx, cy) = vertices[i], vertices[(i + 1) % 3], vertices[(i + 2) % 3]
    u, v = (bx - ax, by - ay), (cx - ax, cy - ay)
    return math.degrees(math.acos((u[0] * v[0] + u[1] * v[1]) / (math.hypot(*u) * math.hypot(*v))))


def test_segment_answers_match_the_pieces_drawn():
    for scene in of_kind("segments"):
        assert scene.answer == sum(scene.given) and 2 <= len(scene.given) <= 3
        (start, end), *ticks = scene.lines
        xs = [tick[0][0] for tick in ticks]
        assert xs[0] == start[0] and xs[-1] == end[0]
        widths = [b - a for a, b in zip(xs, xs[1:])]  # drawn to scale
        assert [w / sum(widths) for w in widths] == pytest.approx([n / scene.answer for n in scene.given])
        assert [label.text for label in scene.labels[:-2]] == [str(n) for n in scene.given]


def test_pixels_differ_between_rows_with_different_answers():
    rows = g.make_rows(12, seed=3, split="train")
    pairs = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1:]
             if a["reward_model"]["ground_truth"] != b["reward_model"]["ground_truth"]]
    assert len(pairs) > 30
    pixels = {id(r): Image.open(io.BytesIO(r["images"][0]["bytes"])).convert("RGB").tobytes() for r in rows}
    for a, b in pairs:
        assert sum(x != y for x, y in zip(pixels[id(a)], pixels[id(b)])) > 300  # not a few stray pixels
    same_question = [(a, b) for a, b in pairs if a["prompt"] == b["prompt"]]
    assert same_question  # identical text, different answers: the image decides
