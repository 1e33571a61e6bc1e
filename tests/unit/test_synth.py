"""The synthetic flowers generator: deterministic, balanced, real JPEGs in the recipe's CSV layout."""
from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from server_harness import ROOT
from training import synth


def _tree(folder: str) -> dict[str, bytes]:
    files = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, folder)] = f.read()
    return files


def _rows(path: str) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("synth") / "flowers")
    return synth.generate(folder, num_images=53, seed=11, eval_fraction=0.2, min_size=32, max_size=64)


def test_render_is_deterministic_for_a_seed():
    assert synth.render("roses", 5) == synth.render("roses", 5)
    assert synth.render("roses", 5) != synth.render("roses", 6)
    assert synth.render(2, 5) == synth.render("roses", 5)
    assert synth.render("roses", 5) != synth.render("tulips", 5)


def test_render_makes_a_textured_jpeg_within_the_size_range():
    for label in synth.CLASSES:
        image = Image.open(io.BytesIO(synth.render(label, 3, min_size=200, max_size=320)))
        assert image.format == "JPEG" and image.mode == "RGB"
        assert all(200 <= side <= 320 for side in image.size)
        pixels = np.asarray(image, dtype=np.float32)
        assert pixels.std() > 20, f"{label} looks like a flat patch"
    assert Image.open(io.BytesIO(synth.render("daisy", 1, size=(48, 40)))).size == (48, 40)


def test_render_rejects_unknown_classes():
    with pytest.raises(ValueError, match="unknown class"):
        synth.render("orchids", 1)
    with pytest.raises(ValueError, match="out of range"):
        synth.render(5, 1)


def test_generate_writes_balanced_classes_and_splits(dataset):
    train, eval_ = _rows(dataset.train_csv), _rows(dataset.eval_csv)
    assert (len(train), len(eval_)) == (dataset.num_train, dataset.num_eval) and len(train) + len(eval_) == 53
    per_class = Counter(label for _, label in train + eval_)
    assert set(per_class) == set(synth.CLASSES) and max(per_class.values()) - min(per_class.values()) <= 1
    in_eval = Counter(label for _, label in eval_)
    assert set(in_eval) == set(synth.CLASSES) and max(in_eval.values()) - min(in_eval.values()) <= 1
    assert not {p for p, _ in train} & {p for p, _ in eval_}
    with open(dataset.labels_file) as f:
        assert f.read().split("\n")[:-1] == list(synth.CLASSES)


def test_csv_paths_are_relative_to_the_dataset_folder_and_match_their_class(dataset):
    rows = _rows(dataset.train_csv) + _rows(dataset.eval_csv)
    assert rows
    for path, label in rows:
        assert not os.path.isabs(path) and path.split("/")[0] == label
        with Image.open(os.path.join(dataset.output_dir, path)) as image:
            assert image.format == "JPEG" and all(32 <= side <= 64 for side in image.size)


def test_generate_is_deterministic_for_a_seed(dataset, tmp_path):
    again = synth.generate(str(tmp_path / "again"), num_images=53, seed=11, min_size=32, max_size=64, workers=2)
    assert _tree(again.output_dir) == _tree(dataset.output_dir)
    other = synth.generate(str(tmp_path / "other"), num_images=53, seed=12, min_size=32, max_size=64)
    assert _tree(other.output_dir) != _tree(dataset.output_dir)


def test_a_smaller_rerun_leaves_only_its_own_images(tmp_path):
    """The larger run's images stayed in the class folders, where the folder form of `petal tfrecords` reads."""
    folder = str(tmp_path / "set")
    synth.generate(folder, num_images=12, seed=1, min_size=32, max_size=40)
    (tmp_path / "set" / "roses" / "mine.jpg").write_bytes(b"a user's file")
    smaller = synth.generate(folder, num_images=6, seed=1, min_size=32, max_size=40)
    images = sorted(p for p in _tree(folder) if p.endswith(".jpg"))
    listed = sorted(path for path, _ in _rows(smaller.train_csv) + _rows(smaller.eval_csv))
    assert images == sorted([*listed, "roses/mine.jpg"])
    with pytest.raises(ValueError, match="at least 1"):
        synth.generate(folder, num_images=0, seed=1)


def test_petal_synth_command(tmp_path):
    out = tmp_path / "cli"
    run = subprocess.run([sys.executable, "-m", "petal", "synth", "--output_dir", str(out), "--num_images", "10",
                          "--seed", "3", "--min_size", "32", "--max_size", "48"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "8 train + 2 eval" in run.stdout
    assert len(_rows(str(out / "train_set.csv"))) == 8
    bad = subprocess.run([sys.executable, "-m", "petal", "synth", "--output_dir", str(out), "--min_size", "8"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "min_size" in bad.stderr
