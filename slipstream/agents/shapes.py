"""The ``shapes`` task of ``slipstream data make``: count the shapes drawn in a picture, made offline.

A verifiable visual task for vision-language RL that needs no download: each row is a small PNG (white,
``SIZE`` pixels square) with 1 to ``MAX_SHAPES`` circles, squares and triangles of random colours, one per
cell of a 3 x 3 grid at a random place inside its cell (so shapes never overlap and a count is well
defined), and a question about it: how many shapes in all, or how many of one kind (which may be 0). The
answer is an integer, scored by the ``shapes`` reward (the last integer of the reply, as ``arithmetic``).

Rows are verl's multi-modal format: ``images`` holds one ``{"bytes": <png>, "path": None}`` (HF datasets'
image layout), the prompt one ``<image>`` placeholder. ``extra_info.problem`` lists the shapes drawn;
the held-out split hashes it (every prompt text repeats, the pictures do not). The same seed draws the same
shapes and Pillow draws them to the same pixels, so a file is reproducible.

Worked example::

    row = shapes_row(random.Random(0), 0)
    row["reward_model"]["ground_truth"]          # "4"
    row["images"][0]["bytes"][:8]                # b"\\x89PNG\\r\\n\\x1a\\n"
"""

from __future__ import annotations

import io
import random
from typing import Any

SIZE = 112  # 4 x 4 merged patches of Qwen2-VL (28 pixels each): 16 image tokens, a short prompt
GRID = 3
MAX_SHAPES = 6
KINDS = ("circle", "square", "triangle")
PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles"}
# Saturated colours far from the white background and from each other (names only for extra_info).
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "orange": (240, 150, 30),
    "purple": (140, 60, 190),
    "black": (20, 20, 20),
}
PROMPT_ALL = "<image>How many shapes are in the picture? Reply with only the number."
PROMPT_KIND = "<image>How many {kinds} are in the picture? Reply with only the number."


def shapes_row(rng: random.Random, index: int) -> dict[str, Any]:
    """One row: a picture of random shapes and a question whose answer is a count."""
    cells = rng.sample(range(GRID * GRID), rng.randint(1, MAX_SHAPES))
    shapes = [_draw_spec(rng, cell) for cell in sorted(cells)]
    if rng.random() < 0.5:
        prompt, answer = PROMPT_ALL, len(shapes)
    else:
        kind = rng.choice(KINDS)
        prompt, answer = PROMPT_KIND.format(kinds=PLURAL[kind]), sum(s["kind"] == kind for s in shapes)
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "images": [{"bytes": render(shapes), "path": None}],
        "data_source": "shapes",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"index": index, "problem": shapes},
    }


def _draw_spec(rng: random.Random, cell: int) -> dict[str, Any]:
    step = SIZE // GRID
    size = rng.randint(step // 2, step - 6)
    x = (cell % GRID) * step + rng.randint(2, step - size - 2)
    y = (cell // GRID) * step + rng.randint(2, step - size - 2)
    return {
        "kind": rng.choice(KINDS),
        "colour": rng.choice(sorted(COLOURS)),
        "box": [x, y, x + size, y + size],
    }


def render(shapes: list[dict[str, Any]]) -> bytes:
    """The PNG of ``shapes`` (as in ``extra_info.problem``) on a white square."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (SIZE, SIZE), "white")
    draw = ImageDraw.Draw(im)
    for s in shapes:
        x0, y0, x1, y1 = s["box"]
        fill = COLOURS[s["colour"]]
        if s["kind"] == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif s["kind"] == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([((x0 + x1) // 2, y0), (x0, y1), (x1, y1)], fill=fill)
    buf = io.BytesIO()
    im.save(buf, format="PNG", optimize=False)
    return buf.getvalue()
