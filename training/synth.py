"""Synthetic flowers: a deterministic stand-in for the recipe's flower photos.

Every image is drawn from a seed, so tests and the default model get the same data on any machine without a
download. The five classes differ in shape and colour at once (petal count and shape, centre, stem and leaves),
while position, scale, rotation, tilt, background clutter, lighting, noise, JPEG quality and image size vary per
image, so telling them apart takes a real CNN rather than a mean-colour threshold, yet a small CNN at 64-96 px
separates them reliably.

Layout written by `generate` (and `petal synth`):

    D/<class>/<class>_<NNNNNN>.jpg   one folder per class
    D/train_set.csv, D/eval_set.csv  rows `path,label` without a header, like the recipe's train_set.csv;
                                     paths are relative to D, so the folder can be moved or copied as a whole
    D/labels.txt                     one class name per line, in label-id order
"""
from __future__ import annotations

import argparse
import csv
import io
import logging
import math
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import numpy as np
from numpy.typing import ArrayLike
from PIL import Image, ImageDraw, ImageFilter

from training import PROGRESS_LOGGER

progress = logging.getLogger(PROGRESS_LOGGER)  # INFO even when quiet: see petal.configure_logging

CLASSES: tuple[str, ...] = ("daisy", "dandelion", "roses", "sunflowers", "tulips")
TRAIN_CSV = "train_set.csv"
EVAL_CSV = "eval_set.csv"
LABELS_FILE = "labels.txt"

Colour = tuple[int, int, int]


@dataclass(frozen=True)
class Pose:
    """Where one flower head sits: local units are head radii, y points down, (0, 0) is the head's centre."""

    x: float
    y: float
    radius: float
    angle: float
    squash: float

    def place(self, points: np.ndarray) -> list[tuple[float, float]]:
        """Local [n, 2] points to image coordinates: tilt (squash y), rotate, scale, move."""
        local = points * [1.0, self.squash]
        cos, sin = math.cos(self.angle), math.sin(self.angle)
        xs = self.x + self.radius * (local[:, 0] * cos - local[:, 1] * sin)
        ys = self.y + self.radius * (local[:, 0] * sin + local[:, 1] * cos)
        return list(zip(xs.tolist(), ys.tolist(), strict=True))


def _ellipse(cx: float, cy: float, rx: float, ry: float, turn: float = 0.0, n: int = 20) -> np.ndarray:
    t = np.linspace(0.0, 2.0 * math.pi, n, endpoint=False)
    x, y = rx * np.cos(t), ry * np.sin(t)
    cos, sin = math.cos(turn), math.sin(turn)
    return np.stack([cx + x * cos - y * sin, cy + x * sin + y * cos], axis=1)


def _petal(direction: float, inner: float, outer: float, width: float, pointed: bool) -> np.ndarray:
    """A petal from radius `inner` to `outer` along `direction`: rounded (ellipse) or lance-shaped (pointed tip)."""
    t = np.linspace(0.0, 1.0, 9)
    half = width * (np.sin(math.pi * t) if not pointed else np.sin(math.pi * t ** 0.7) * (1.0 - 0.25 * t))
    along = inner + (outer - inner) * t
    side = np.concatenate([np.stack([along, half], 1), np.stack([along[::-1], -half[::-1]], 1)])
    cos, sin = math.cos(direction), math.sin(direction)
    return np.stack([side[:, 0] * cos - side[:, 1] * sin, side[:, 0] * sin + side[:, 1] * cos], axis=1)


def _jitter(rng: np.random.Generator, colour: ArrayLike, amount: float) -> Colour:
    return cast(Colour, tuple(int(c) for c in np.clip(np.asarray(colour) + rng.normal(0.0, amount, 3), 0, 255)))


def _shade(colour: ArrayLike, factor: float) -> Colour:
    return cast(Colour, tuple(int(c) for c in np.clip(np.asarray(colour) * factor, 0, 255)))


def _stem(draw: ImageDraw.ImageDraw, pose: Pose, rng: np.random.Generator, length: float, width: float,
          colour: Colour, leaves: int, leaf_shape: tuple[float, float]) -> None:
    """A slightly curved stem hanging below the head, with leaves along it."""
    bend = rng.uniform(-0.4, 0.4)
    t = np.linspace(0.0, 1.0, 12)
    spine = np.stack([bend * t ** 2, t * length], axis=1)
    draw.line(pose.place(spine), fill=colour, width=max(2, int(width * pose.radius)))
    for i in range(leaves):
        at = rng.uniform(0.3, 0.9) * length
        side = 1 if i % 2 == 0 else -1
        leaf_len, leaf_w = leaf_shape
        base = np.array([bend * (at / length) ** 2, at])
        leaf = _petal(-math.pi / 2 + side * rng.uniform(0.5, 1.2), 0.0, leaf_len, leaf_w, pointed=True) + base
        draw.polygon(pose.place(leaf), fill=_jitter(rng, _shade(colour, 1.1), 10))


def _daisy(draw: ImageDraw.ImageDraw, pose: Pose, rng: np.random.Generator) -> None:
    """Many thin white rounded petals around a small yellow disc."""
    _stem(draw, pose, rng, rng.uniform(2.0, 4.0), 0.06, _jitter(rng, (60, 140, 50), 15), 2, (0.8, 0.12))
    count = int(rng.integers(16, 25))
    phase = rng.uniform(0, 2 * math.pi)
    base = _jitter(rng, (245, 245, 240), 6)
    outline = _shade(base, 0.75)
    for i in range(count):
        direction = phase + 2 * math.pi * i / count + rng.normal(0, 0.04)
        petal = _petal(direction, 0.15, rng.uniform(0.85, 1.0), rng.uniform(0.09, 0.12), pointed=False)
        draw.polygon(pose.place(petal), fill=_jitter(rng, base, 5), outline=outline)
    draw.polygon(pose.place(_ellipse(0, 0, 0.24, 0.24)), fill=_jitter(rng, (240, 190, 20), 12))
    for _ in range(12):
        cx, cy = rng.uniform(-0.14, 0.14, 2)
        dot = _ellipse(cx, cy, 0.03, 0.03, n=6)
        draw.polygon(pose.place(dot), fill=_jitter(rng, (200, 140, 10), 10))


def _dandelion(draw: ImageDraw.ImageDraw, pose: Pose, rng: np.random.Generator) -> None:
    """A dense fuzzy ball of very thin yellow rays in layers, no separate centre; a pale hollow stem."""
    _stem(draw, pose, rng, rng.uniform(2.0, 3.5), 0.07, _jitter(rng, (120, 170, 80), 12), 2, (0.9, 0.08))
    yellow = np.asarray(_jitter(rng, (250, 215, 20), 8), dtype=float)
    for layer, (reach, shade) in enumerate(((1.0, 0.88), (0.8, 0.95), (0.6, 1.0), (0.4, 1.05))):
        count = 36 - 6 * layer
        for _ in range(count):
            direction = rng.uniform(0, 2 * math.pi)
            ray = _petal(direction, 0.0, reach * rng.uniform(0.85, 1.05), 0.045, pointed=False)
            draw.polygon(pose.place(ray), fill=_jitter(rng, _shade(yellow, shade), 8))
    draw.polygon(pose.place(_ellipse(0, 0, 0.18, 0.18)), fill=_jitter(rng, (235, 170, 10), 8))


def _roses(draw: ImageDraw.ImageDraw, pose: Pose, rng: np.random.Generator) -> None:
    """A round head of large overlapping red petals in rings, darker inwards, with spiral folds; thorny stem."""
    green = _jitter(rng, (40, 100, 40), 12)
    _stem(draw, pose, rng, rng.uniform(1.8, 3.2), 0.08, green, 3, (0.7, 0.3))
    for i in range(5):
        sepal = _petal(math.pi / 2 + (i - 2) * 0.5, 0.3, 1.15, 0.15, pointed=True)
        draw.polygon(pose.place(sepal), fill=green)
    red = np.asarray(_jitter(rng, (205, 20, 30), 10), dtype=float)
    rings = ((0.95, 0.5, 5), (0.7, 0.38, 5), (0.48, 0.28, 4), (0.28, 0.18, 3))
    for depth, (reach, size, count) in enumerate(rings):
        phase = rng.uniform(0, 2 * math.pi)
        for i in range(count):
            direction = phase + 2 * math.pi * i / count
            cx, cy = (reach - size) * np.array([math.cos(direction), math.sin(direction)])
            petal = _ellipse(cx, cy, size, size * 0.85, turn=direction)
            colour = _jitter(rng, _shade(red, 1.0 - 0.13 * depth), 8)
            draw.polygon(pose.place(petal), fill=colour, outline=_shade(colour, 0.6))
    spiral_t = np.linspace(0, 4 * math.pi, 40)
    spiral = np.stack([np.cos(spiral_t), np.sin(spiral_t)], 1) * (0.04 + 0.05 * spiral_t)[:, None]
    draw.line(pose.place(spiral * rng.choice([-1, 1], size=2)), fill=_shade(red, 0.45),
              width=max(1, int(0.04 * pose.radius)))


def _sunflowers(draw: ImageDraw.ImageDraw, pose: Pose, rng: np.random.Generator) -> None:
    """A big dark seed disc framed by one or two rings of broad pointed golden petals; thick stem, broad leaves."""
    _stem(draw, pose, rng, rng.uniform(1.8, 3.0), 0.14, _jitter(rng, (50, 120, 40), 12), 2, (0.9, 0.4))
    gold = np.asarray(_jitter(rng, (250, 175, 15), 10), dtype=float)
    count = int(rng.integers(16, 23))
    for ring, shade in ((0, 0.82), (1, 1.0)):
        phase = rng.uniform(0, 2 * math.pi) + ring * math.pi / count
        for i in range(count):
            direction = phase + 2 * math.pi * i / count + rng.normal(0, 0.05)
            petal = _petal(direction, 0.4, rng.uniform(0.9, 1.0), rng.uniform(0.13, 0.17), pointed=True)
            draw.polygon(pose.place(petal), fill=_jitter(rng, _shade(gold, shade), 8))
    brown = _jitter(rng, (75, 40, 15), 8)
    draw.polygon(pose.place(_ellipse(0, 0, 0.48, 0.48, n=28)), fill=brown)
    golden_angle = math.pi * (3 - math.sqrt(5))
    n = np.arange(1, 60)
    seeds = np.stack([np.cos(n * golden_angle), np.sin(n * golden_angle)], 1) * (0.42 * np.sqrt(n / 60))[:, None]
    for x, y in seeds:
        draw.polygon(pose.place(_ellipse(x, y, 0.03, 0.03, n=5)), fill=_shade(brown, rng.uniform(0.4, 1.5)))


def _tulips(draw: ImageDraw.ImageDraw, pose: Pose, rng: np.random.Generator) -> None:
    """A closed upright cup of three pointed pink/purple petals on a long straight stem with long blade leaves."""
    green = _jitter(rng, (70, 140, 60), 12)
    _stem(draw, pose, rng, rng.uniform(2.5, 4.0), 0.07, green, 2, (1.8, 0.22))
    palette = ((225, 60, 170), (160, 60, 210), (240, 120, 200), (130, 50, 180))
    colour = np.asarray(_jitter(rng, palette[int(rng.integers(len(palette)))], 12), dtype=float)
    for side, shade in ((-1, 0.8), (1, 0.8), (0, 1.0)):
        petal = _petal(-math.pi / 2 + side * 0.35, -0.55, 1.0, 0.42 if side else 0.45, pointed=True)
        petal = petal + [side * 0.2, 0.35]
        fill = _jitter(rng, _shade(colour, shade), 6)
        draw.polygon(pose.place(petal), fill=fill, outline=_shade(fill, 0.6))


DRAWERS: tuple[Callable[[ImageDraw.ImageDraw, Pose, np.random.Generator], None], ...] = (
    _daisy, _dandelion, _roses, _sunflowers, _tulips)
UPRIGHT = {"tulips"}


def _background(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A blurred meadow: a sky-to-ground gradient with grass blades, blobs and out-of-focus bokeh."""
    top = rng.uniform([90, 120, 140], [200, 220, 250])
    bottom = rng.uniform([30, 60, 20], [120, 150, 80])
    horizon = rng.uniform(0.2, 0.7)
    t = np.clip((np.linspace(0, 1, height) - horizon) * 4 + 0.5, 0, 1)[:, None, None]
    pixels = np.broadcast_to(top * (1 - t) + bottom * t, (height, width, 3)).astype(np.uint8)
    image = Image.fromarray(np.ascontiguousarray(pixels))
    draw = ImageDraw.Draw(image)
    scale = min(width, height)
    for _ in range(int(rng.integers(5, 15))):
        x, y = rng.uniform(0, width), rng.uniform(0, height)
        rx, ry = rng.uniform(0.03, 0.2, 2) * scale
        muted = rng.uniform([40, 50, 30], [150, 160, 120])
        draw.polygon([tuple(p) for p in _ellipse(x, y, rx, ry, rng.uniform(0, math.pi)).tolist()],
                     fill=_jitter(rng, muted, 10))
    for _ in range(int(rng.integers(20, 60))):
        x = rng.uniform(0, width)
        y = rng.uniform(height * horizon, height * 1.1)
        length = rng.uniform(0.05, 0.3) * scale
        lean = rng.uniform(-0.4, 0.4)
        draw.line([(x, y), (x + lean * length, y - length)], fill=_jitter(rng, (60, 120, 50), 25),
                  width=int(rng.integers(1, 4)))
    return image.filter(ImageFilter.GaussianBlur(rng.uniform(1.0, 4.0) * scale / 300))


def _lighting(rng: np.random.Generator, image: Image.Image) -> np.ndarray:
    """Uneven light (a gain gradient in a random direction), a colour cast and sensor noise."""
    width, height = image.size
    pixels = np.asarray(image, dtype=np.float32)
    direction = rng.uniform(0, 2 * math.pi)
    ramp = (np.cos(direction) * np.linspace(-0.5, 0.5, width)[None, :]
            + np.sin(direction) * np.linspace(-0.5, 0.5, height)[:, None])
    gain = rng.uniform(0.7, 1.2) + rng.uniform(0.0, 0.5) * ramp
    cast = rng.uniform(0.9, 1.1, 3).astype(np.float32)
    pixels = pixels * gain[:, :, None].astype(np.float32) * cast
    sigma = rng.uniform(0.0, 8.0)
    if sigma > 0.5:
        pixels += rng.normal(0.0, sigma, size=(height // 2 + 1, width // 2 + 1, 1)).astype(np.float32).repeat(
            2, 0).repeat(2, 1)[:height, :width]
    return np.clip(pixels, 0, 255).astype(np.uint8)


def class_index(label: int | str) -> int:
    """A class name or id to its id, with a clear error for anything else."""
    if isinstance(label, str):
        if label not in CLASSES:
            raise ValueError(f"unknown class {label!r}; expected one of {', '.join(CLASSES)}")
        return CLASSES.index(label)
    if not 0 <= int(label) < len(CLASSES):
        raise ValueError(f"class id {label} out of range 0..{len(CLASSES) - 1}")
    return int(label)


def _photo_size(rng: np.random.Generator, min_size: int, max_size: int) -> tuple[int, int]:
    """A camera-like frame: the long side in [min_size, max_size], landscape or portrait up to 4:3."""
    long = int(rng.integers(min_size, max_size + 1))
    short = max(min_size, int(long * rng.uniform(0.75, 1.0)))
    return (long, short) if rng.uniform() < 0.5 else (short, long)


def render_image(label: int | str, seed: int, min_size: int = 200, max_size: int = 640,
                 size: tuple[int, int] | None = None) -> Image.Image:
    """One flower photo of a class as an RGB image; the same (label, seed, sizes) always gives the same pixels."""
    index = class_index(label)
    rng = np.random.default_rng([seed, index])
    width, height = size or _photo_size(rng, min_size, max_size)
    image = _background(rng, width, height)
    draw = ImageDraw.Draw(image)
    short = min(width, height)
    heads = 1 if rng.uniform() < 0.75 else 2
    for head in range(heads):
        radius = short * (rng.uniform(0.22, 0.34) if head == 0 else rng.uniform(0.12, 0.18))
        upright = CLASSES[index] in UPRIGHT
        pose = Pose(
            x=rng.uniform(radius, width - radius),
            y=rng.uniform(radius, max(radius + 1, height - 1.5 * radius)),
            radius=radius,
            angle=rng.uniform(-0.5, 0.5) if upright else rng.uniform(-0.6, 0.6),
            squash=1.0 if upright else rng.uniform(0.65, 1.0))
        DRAWERS[index](draw, pose, rng)
    return Image.fromarray(_lighting(rng, image))


def render(label: int | str, seed: int, min_size: int = 200, max_size: int = 640,
           size: tuple[int, int] | None = None, quality: int | None = None) -> bytes:
    """One flower photo as JPEG bytes: what tests and demos use when they need a real, decodable photo."""
    image = render_image(label, seed, min_size, max_size, size)
    if quality is None:
        quality = int(np.random.default_rng([seed, class_index(label), 1]).integers(60, 96))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


@dataclass(frozen=True)
class Item:
    """One image of the dataset: its path relative to the dataset folder, class id, seed and split."""

    path: str
    label: int
    seed: int
    eval: bool


@dataclass(frozen=True)
class Dataset:
    """What `generate` wrote."""

    output_dir: str
    train_csv: str
    eval_csv: str
    labels_file: str
    num_train: int
    num_eval: int


def plan(num_images: int, seed: int, eval_fraction: float = 0.2) -> list[Item]:
    """Which images make up the dataset: classes round-robin (balanced to within one image), per-image seeds
    from the dataset seed, and an eval split of round(num_images * eval_fraction) images spread evenly over the
    classes, so train and eval are balanced too."""
    if num_images < 1:
        raise ValueError("--num_images must be at least 1")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError("eval_fraction must be in [0, 1)")
    seeds = np.random.SeedSequence(seed).generate_state(max(num_images, 1), dtype=np.uint32)
    per_class = [list(range(c, num_images, len(CLASSES))) for c in range(len(CLASSES))]
    split_rng = np.random.default_rng([seed, 2])
    num_eval = round(num_images * eval_fraction)
    held_out: set[int] = set()
    for c, indices in enumerate(per_class):
        count = num_eval // len(CLASSES) + (1 if c < num_eval % len(CLASSES) else 0)
        held_out.update(split_rng.permutation(indices)[:count].tolist())
    return [Item(path=f"{CLASSES[i % len(CLASSES)]}/{CLASSES[i % len(CLASSES)]}_{i:06d}.jpg",
                 label=i % len(CLASSES), seed=int(seeds[i]), eval=i in held_out)
            for i in range(num_images)]


def _write_item(job: tuple[str, Item, int, int]) -> None:
    output_dir, item, min_size, max_size = job
    path = os.path.join(output_dir, item.path)
    with open(path + ".tmp", "wb") as f:
        f.write(render(item.label, item.seed, min_size, max_size))
    os.replace(path + ".tmp", path)


PROGRESS_SECONDS = 5.0


def _report_progress(done: Iterator[None], total: int) -> None:
    """Drain the image writers, logging progress every PROGRESS_SECONDS and once at the end, as training does (a
    line per 5% was 20 lines in well under a second for a small set)."""
    started = last = time.monotonic()
    for count, _ in enumerate(done, start=1):
        now = time.monotonic()
        if now - last >= PROGRESS_SECONDS or count == total:
            last = now
            progress.info("synth progress", extra={"fields": {"done": count, "total": total,
                                                          "images_per_s": round(count / max(now - started, 1e-9), 1)}})


def _remove_earlier_images(output_dir: str, planned: set[str]) -> None:
    """An earlier, larger run's images that this one does not write: the CSVs would not list them, but the folder
    form of `petal tfrecords` would read them. Only this module's own names (<class>/<class>_<NNNNNN>.jpg) go."""
    for name in CLASSES:
        for entry in os.listdir(os.path.join(output_dir, name)):
            path = f"{name}/{entry}"
            if re.fullmatch(rf"{name}_\d{{6}}\.jpg", entry) and path not in planned:
                os.remove(os.path.join(output_dir, path))


def generate(output_dir: str, num_images: int, seed: int, eval_fraction: float = 0.2, min_size: int = 200,
             max_size: int = 640, workers: int = 1) -> Dataset:
    """Write the dataset (see the module docstring for the layout); rerunning with the same flags rewrites the
    same bytes."""
    if not 16 <= min_size <= max_size:
        raise ValueError("need 16 <= min_size <= max_size")
    items = plan(num_images, seed, eval_fraction)
    for name in CLASSES:
        os.makedirs(os.path.join(output_dir, name), exist_ok=True)
    _remove_earlier_images(output_dir, {item.path for item in items})
    jobs = [(output_dir, item, min_size, max_size) for item in items]
    if workers > 1:
        # Spawned, not forked: a caller may already run TensorFlow threads, and forking those can deadlock.
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            _report_progress(pool.imap(_write_item, jobs, chunksize=16), num_images)
    else:
        _report_progress(map(_write_item, jobs), num_images)
    for name, in_eval in ((TRAIN_CSV, False), (EVAL_CSV, True)):
        with open(os.path.join(output_dir, name), "w", newline="") as f:
            csv.writer(f).writerows((item.path, CLASSES[item.label]) for item in items if item.eval == in_eval)
    with open(os.path.join(output_dir, LABELS_FILE), "w") as f:
        f.write("".join(f"{name}\n" for name in CLASSES))
    num_eval = sum(item.eval for item in items)
    return Dataset(output_dir, os.path.join(output_dir, TRAIN_CSV), os.path.join(output_dir, EVAL_CSV),
                   os.path.join(output_dir, LABELS_FILE), num_images - num_eval, num_eval)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="petal synth", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True, help="folder to write the class folders and CSVs into")
    parser.add_argument("--num_images", type=int, default=1000, help="total images, split evenly over classes")
    parser.add_argument("--seed", type=int, default=0, help="the same seed always gives the same dataset")
    parser.add_argument("--eval_fraction", type=float, default=0.2, help="share of each class held out for eval")
    parser.add_argument("--min_size", type=int, default=200, help="smallest image side in pixels")
    parser.add_argument("--max_size", type=int, default=640, help="largest image side in pixels")
    parser.add_argument("--workers", type=int, default=1, help="processes drawing images in parallel")
    args = parser.parse_args(argv)
    try:
        dataset = generate(args.output_dir, args.num_images, args.seed, args.eval_fraction, args.min_size,
                           args.max_size, args.workers)
    except ValueError as e:
        parser.error(str(e))
    except OSError as e:  # an --output_dir under a file, say
        print(f"petal synth: {e}", file=sys.stderr)
        return 2
    print(f"wrote {dataset.num_train} train + {dataset.num_eval} eval images to {dataset.output_dir} "
          f"({dataset.train_csv}, {dataset.eval_csv}, {dataset.labels_file})")
    return 0
