"""Offline geo3k-format data: simple figures drawn with PIL whose answers need the picture.

verl's preprocessed Geometry3k (3,002 problems) cannot be downloaded here. This writes rows in
its columns (`make_row`) for three kinds of problem, one kind after another by row index:

    count     1-6 circles, squares or triangles (one kind a figure) in four colours: "How many
              triangles are in the figure?"
    angle     a triangle with two of its angles labelled in degrees in the picture: find the third, x
    segments  a segment AB cut into 2-3 pieces with their lengths labelled: find the length of AB

The text never states a number the answer depends on (counts, angles and lengths are only in the
image), so a model that ignores the image can only guess. Everything is a function of the seed.

    python -m dapo_megatron.data.geo3k_synth OUT_DIR [--train 2000] [--val 300] [--seed 0] [--kinds count]
"""
from __future__ import annotations

import argparse
import io
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFont

DATA_SOURCE = "hiyouga/geometry3k"  # the geo3k reward scores these rows (reward/geo3k.py)
# verl's examples/data_preprocess/geo3k.py instruction, word for word.
INSTRUCTION = ("You FIRST think about the reasoning process as an internal monologue and then provide the final "
               "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer "
               "MUST BE put in \\boxed{}.")
# 224 = 8 x 28 = 7 x 32: a whole number of merged patches for Qwen2.5-VL (14 px patches, 2x2 merge)
# and Qwen3-VL (16 px, 2x2), so the image processor never resizes the figure.
SIZE = 224
COLOURS = {"red": (220, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 220), "yellow": (230, 190, 30)}
SHAPE_KINDS = ("circle", "square", "triangle")
GRID = 3  # count figures put one shape per cell of a GRID x GRID layout: shapes never overlap
FONT_SIZE = 16
MARGIN = 36  # keeps a label drawn outside a vertex or below a segment inside the picture

Point = tuple[float, float]


@dataclass(frozen=True)
class Shape:
    kind: str  # one of SHAPE_KINDS
    colour: str  # a COLOURS key
    box: tuple[int, int, int, int]  # (x0, y0, x1, y1), pixels, inclusive


@dataclass(frozen=True)
class Label:
    text: str
    xy: Point  # where the centre of the text goes


@dataclass(frozen=True)
class Scene:
    """What a figure shows: the generator's own description, which tests check the answer against."""
    kind: str  # "count" | "angle" | "segments"
    question: str  # the problem text, without the <image> placeholder and the instruction
    answer: int
    shapes: tuple[Shape, ...] = ()
    lines: tuple[tuple[Point, Point], ...] = ()  # black strokes
    labels: tuple[Label, ...] = ()
    given: tuple[int, ...] = ()  # the numbers written in the picture (angles, lengths)


def count_scene(rng: random.Random, size: int) -> Scene:
    """1-6 shapes of one kind (named in the question) in random colours, one per grid cell, all of
    one size. Measured with the tiny VL tower (assets/vl.py): with the kinds mixed in a figure
    ("How many shapes?") it reads the count slowly (a triangle covers half a square's pixels);
    with one kind a figure, named, the count is the covered area over the kind's, which it learns."""
    kind = rng.choice(SHAPE_KINDS)
    colours = [rng.choice(list(COLOURS)) for _ in range(rng.randint(1, 6))]
    cells = rng.sample(range(GRID * GRID), len(colours))
    shapes = tuple(Shape(kind, c, _box_in_cell(rng, cell, size // GRID)) for c, cell in zip(colours, cells))
    return Scene("count", f"How many {kind}s are in the figure?", len(shapes), shapes=shapes)


def _box_in_cell(rng: random.Random, cell: int, cell_px: int) -> tuple[int, int, int, int]:
    row, col = divmod(cell, GRID)
    side = cell_px * 4 // 5
    x0 = col * cell_px + rng.randint(2, cell_px - side - 2)
    y0 = row * cell_px + rng.randint(2, cell_px - side - 2)
    return x0, y0, x0 + side, y0 + side


def angle_scene(rng: random.Random, size: int) -> Scene:
    """A triangle drawn with its true angles; two are labelled in degrees, the third is x."""
    while True:
        a, b = rng.randint(25, 95), rng.randint(25, 95)
        if 180 - a - b >= 25:
            break
    angles = [a, b, 180 - a - b]
    rng.shuffle(angles)
    unknown = rng.randrange(3)
    vertices = _triangle(angles, size)
    cx, cy = sum(x for x, _ in vertices) / 3, sum(y for _, y in vertices) / 3
    labels = []
    for i, (x, y) in enumerate(vertices):  # outside the vertex, away from the centroid
        d = math.hypot(x - cx, y - cy)
        text = "x" if i == unknown else f"{angles[i]}°"
        labels.append(Label(text, (x + (x - cx) / d * 18, y + (y - cy) / d * 18)))
    lines = tuple((vertices[i], vertices[(i + 1) % 3]) for i in range(3))
    given = tuple(angles[i] for i in range(3) if i != unknown)
    return Scene("angle", "Two angles of the triangle in the figure are marked in degrees. Find x.",
                 angles[unknown], lines=lines, labels=tuple(labels), given=given)


def _triangle(angles: list[int], size: int) -> list[Point]:
    """Vertices (image coordinates, y down) of a triangle with these angles at vertices 0, 1, 2,
    on a horizontal base 0-1, scaled and centred into the picture inside MARGIN."""
    a, b, c = (math.radians(t) for t in angles)
    side = math.sin(b) / math.sin(c)  # law of sines: |v0 v2| for a base |v0 v1| = 1
    points = [(0.0, 0.0), (1.0, 0.0), (side * math.cos(a), -side * math.sin(a))]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    scale = (size - 2 * MARGIN) / max(max(xs) - min(xs), max(ys) - min(ys))
    dx = (size - scale * (max(xs) - min(xs))) / 2 - scale * min(xs)
    dy = (size - scale * (max(ys) - min(ys))) / 2 - scale * min(ys)
    return [(x * scale + dx, y * scale + dy) for x, y in points]


def segments_scene(rng: random.Random, size: int) -> Scene:
    """A horizontal segment AB, cut by ticks into 2-3 pieces drawn to scale, lengths written above."""
    lengths = [rng.randint(2, 12) for _ in range(rng.randint(2, 3))]
    x0, x1, y = MARGIN, size - MARGIN, rng.randint(size * 2 // 5, size * 3 // 5)
    cuts = [x0 + (x1 - x0) * sum(lengths[:i]) / sum(lengths) for i in range(len(lengths) + 1)]
    ticks = tuple(((x, y - 6), (x, y + 6)) for x in cuts)
    labels = [Label(str(n), ((left + right) / 2, y - 14)) for n, left, right in zip(lengths, cuts, cuts[1:])]
    labels += [Label("A", (x0, y + 18)), Label("B", (x1, y + 18))]
    return Scene("segments", "The segment AB is divided into pieces whose lengths are marked in the figure. "
                 "Find the length of AB.", sum(lengths), lines=(((x0, y), (x1, y)),) + ticks,
                 labels=tuple(labels), given=tuple(lengths))


SCENES: dict[str, Callable[[random.Random, int], Scene]] = {
    "count": count_scene, "angle": angle_scene, "segments": segments_scene,
}

_DRAW_SHAPE: dict[str, Callable[[ImageDraw.ImageDraw, tuple, tuple], None]] = {
    "circle": lambda draw, box, fill: draw.ellipse(box, fill=fill),
    "square": lambda draw, box, fill: draw.rectangle(box, fill=fill),
    "triangle": lambda draw, box, fill: draw.polygon(
        [((box[0] + box[2]) / 2, box[1]), (box[0], box[3]), (box[2], box[3])], fill=fill),
}


def make_scene(seed: int, split: str, index: int, size: int = SIZE, kinds: tuple[str, ...] = tuple(SCENES)) -> Scene:
    """Row `index` of `split`: its kind from the index (`kinds` in turn), its content from
    (seed, split, index)."""
    unknown = sorted(set(kinds) - set(SCENES))
    if not kinds or unknown:
        raise ValueError(f"problem kinds {unknown or '()'}: choose among {sorted(SCENES)}")
    rng = random.Random(f"geo3k_synth:{seed}:{split}:{index}")  # str seeds hash the same in every process
    return SCENES[kinds[index % len(kinds)]](rng, size)


def render(scene: Scene, size: int = SIZE) -> Image.Image:
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    for shape in scene.shapes:
        _DRAW_SHAPE[shape.kind](draw, shape.box, COLOURS[shape.colour])
    for start, end in scene.lines:
        draw.line([start, end], fill="black", width=2)
    font = ImageFont.load_default(size=FONT_SIZE)  # Pillow's bundled FreeType font: no font files
    for label in scene.labels:
        draw.text(label.xy, label.text, fill="black", font=font, anchor="mm")
    return image


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def make_row(scene: Scene, png: bytes, split: str, index: int) -> dict[str, Any]:
    """One row in verl's geo3k columns; the problem text follows its one <image> as in geo3k."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"<image>{scene.question} {INSTRUCTION}"}],
        "images": [{"bytes": png, "path": None}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(scene.answer)},
        "extra_info": {"split": split, "index": index, "kind": scene.kind},
    }


def make_rows(n: int, seed: int, split: str, size: int = SIZE, kinds: tuple[str, ...] = tuple(SCENES)
              ) -> list[dict[str, Any]]:
    """Rows 0..n-1 of `split` with problems of `kinds`, figures `size` pixels square (160 is the
    smallest that keeps the labels of a 3-piece segment apart at FONT_SIZE)."""
    rows = []
    for i in range(n):
        scene = make_scene(seed, split, i, size, kinds)
        rows.append(make_row(scene, png_bytes(render(scene, size)), split, i))
    return rows


# Spelled out so that a column that is null in every row (images' path) keeps verl's type.
SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("kind", pa.string())])),
])


def write_geo3k(out_dir: str | Path, n_train: int, n_val: int, seed: int, kinds: tuple[str, ...] = tuple(SCENES)
                ) -> tuple[Path, Path]:
    """Write OUT_DIR/train.parquet and OUT_DIR/test.parquet (verl's geo3k file names); returns both."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.parquet", out / "test.parquet"
    for path, split, n in ((paths[0], "train", n_train), (paths[1], "test", n_val)):
        pq.write_table(pa.Table.from_pylist(make_rows(n, seed, split, kinds=kinds), schema=SCHEMA), path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dapo_megatron.data.geo3k_synth", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=2000, help="rows in train.parquet")
    parser.add_argument("--val", type=int, default=300, help="rows in test.parquet")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(SCENES), help="problem kinds, in turn by row (comma-separated)")
    args = parser.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or set(kinds) - set(SCENES):
        parser.error(f"--kinds {args.kinds!r}: choose among {','.join(SCENES)}")
    for path in write_geo3k(args.out_dir, args.train, args.val, args.seed, kinds):
        print(path)


if __name__ == "__main__":
    main()
