"""`petal tfrecords` on a real Beam DirectRunner, over a folder of good, odd and broken files."""
from __future__ import annotations

import glob
import io
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from training import synth, tfrecords

GOOD_PER_CLASS = 3
CLASSES = ("daisy", "roses", "tulips")
FEATURES = {
    "image/encoded": tf.io.FixedLenFeature([], tf.string),
    "image/format": tf.io.FixedLenFeature([], tf.string),
    "image/class/label": tf.io.FixedLenFeature([], tf.int64),
    "image/class/text": tf.io.FixedLenFeature([], tf.string),
    "image/filename": tf.io.FixedLenFeature([], tf.string),
    "image/height": tf.io.FixedLenFeature([], tf.int64),
    "image/width": tf.io.FixedLenFeature([], tf.int64),
}


def _encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def _write(path: str, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _records(pattern: str) -> list[dict]:
    files = sorted(glob.glob(pattern))
    return [{k: v.numpy() for k, v in tf.io.parse_single_example(r, FEATURES).items()}
            for r in tf.data.TFRecordDataset(files)]


@pytest.fixture(scope="module")
def messy(tmp_path_factory):
    """Class folders with good JPEGs, every convertible oddity and every kind of broken file."""
    root = str(tmp_path_factory.mktemp("messy"))
    images = os.path.join(root, "images")
    good = {}
    for c, label in enumerate(CLASSES):
        for i in range(GOOD_PER_CLASS):
            path = _write(os.path.join(images, label, f"good{i}.jpg"), synth.render(label, 100 * c + i, size=(40, 32)))
            with open(path, "rb") as f:
                good[path] = f.read()
    photo = Image.open(io.BytesIO(synth.render("daisy", 7, size=(36, 28))))
    converted = {
        "daisy/alpha.png": _encode(photo.convert("RGBA"), "PNG"),
        "daisy/grey.jpg": _encode(photo.convert("L"), "JPEG"),
        "daisy/grey16.png": _encode(Image.fromarray(np.asarray(photo.convert("L")).astype(np.uint16) * 257), "PNG"),
        "roses/cmyk.jpg": _encode(photo.convert("CMYK"), "JPEG"),
        "roses/palette.gif": _encode(photo.convert("P"), "GIF"),
        "tulips/plain.bmp": _encode(photo, "BMP"),
        "tulips/leaf.webp": _encode(photo, "WEBP"),
    }
    for name, data in converted.items():
        _write(os.path.join(images, name), data)
    some_jpeg = next(iter(good.values()))
    broken = {
        "daisy/truncated.jpg": ("corrupt image", some_jpeg[: len(some_jpeg) // 2]),
        "roses/empty.jpg": ("empty file", b""),
        "tulips/notes.jpg": ("not an image", b"these are my notes, not a photo\n"),
    }
    for name, (_, data) in broken.items():
        _write(os.path.join(images, name), data)
    rows = [f"images/{os.path.relpath(p, images)},{p.split(os.sep)[-2]}" for p in good]
    rows[0] = f"{next(iter(good))},{CLASSES[0]}"  # One absolute path: used as it is.
    rows += [f"images/{name},{name.split('/')[0]}" for name in list(converted) + list(broken)]
    rows += ["images/daisy/good0.jpg,orchids", "images/daisy/missing.jpg,daisy", "only-one-field", ""]
    csv_path = os.path.join(root, "train_set.csv")
    with open(csv_path, "w") as f:
        f.write("\n".join(rows) + "\n")
    labels_file = os.path.join(root, "labels.txt")
    with open(labels_file, "w") as f:
        f.write("\n".join(CLASSES) + "\n")
    return {"root": root, "images": images, "csv": csv_path, "labels_file": labels_file, "good": good,
            "converted": converted, "broken": broken}


@pytest.fixture(scope="module")
def from_csv(messy, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("from_csv") / "records")
    code = tfrecords.main(["--train_csv", messy["csv"], "--validation_csv", messy["csv"],
                           "--labels_file", messy["labels_file"], "--output_dir", out, "--num_shards", "3",
                           "--eval_num_shards", "1", "--direct_num_workers", "1"])
    assert code == 0
    return out


def test_counts_add_up_and_every_bad_row_has_its_reason(messy, from_csv):
    good, converted, broken = len(messy["good"]), len(messy["converted"]), len(messy["broken"])
    errors = [json.loads(line) for line in open(os.path.join(from_csv, "errors.jsonl"))]
    for split in ("train", "eval"):
        mine = {os.path.basename(e["path"]) if e["path"] != "only-one-field" else e["path"]: e["reason"]
                for e in errors if e["split"] == split}
        assert len(mine) == broken + 3
        for name, (reason, _) in messy["broken"].items():
            assert mine[name.split("/")[1]].startswith(reason), mine
        assert mine["good0.jpg"] == "unknown label 'orchids'"
        assert mine["missing.jpg"] == "missing: no such file"
        assert mine["only-one-field"].startswith("bad CSV row")
        assert len(_records(os.path.join(from_csv, f"{split}-*"))) == good + converted


def test_printed_counts(messy, tmp_path, capsys):
    out = str(tmp_path / "records")
    assert tfrecords.main(["--train", messy["csv"], "--labels_file", messy["labels_file"], "--output_dir", out,
                           "--num_shards", "2"]) == 0
    read = len(messy["good"]) + len(messy["converted"]) + len(messy["broken"]) + 3
    written = len(messy["good"]) + len(messy["converted"])
    assert f"train: read {read}, written {written}, errors {read - written}" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["errors.jsonl", "labels.txt", "train-00000-of-00002", "train-00001-of-00002"]


def test_jpegs_round_trip_byte_for_byte(messy, from_csv):
    records = {r["image/filename"].decode(): r for r in _records(os.path.join(from_csv, "train-*"))}
    for path, data in messy["good"].items():
        record = records[path]
        assert record["image/encoded"] == data
        assert record["image/format"] == b"JPEG"
        label = record["image/class/text"].decode()
        assert label == path.split(os.sep)[-2] and record["image/class/label"] == CLASSES.index(label)
        assert (record["image/height"], record["image/width"]) == (32, 40)


def test_other_formats_and_modes_become_rgb_jpegs(messy, from_csv):
    records = {os.path.basename(r["image/filename"].decode()): r for r in _records(os.path.join(from_csv, "eval-*"))}
    for name in messy["converted"]:
        record = records[name.split("/")[1]]
        image = Image.open(io.BytesIO(record["image/encoded"]))
        assert image.format == "JPEG" and image.mode == "RGB", name
        assert image.size == (36, 28) and (record["image/height"], record["image/width"]) == (28, 36)
        assert tf.io.decode_jpeg(record["image/encoded"]).shape == (28, 36, 3)
        assert record["image/class/text"].decode() == name.split("/")[0]


def test_class_folders_as_input_infer_sorted_labels_and_replace_stale_shards(messy, tmp_path):
    out = tmp_path / "records"
    out.mkdir()
    (out / "train-00000-of-00009").write_bytes(b"left over from an earlier run")
    counts = tfrecords.run({"train": messy["images"]}, str(out), tfrecords.infer_labels(messy["images"]),
                           {"train": 1})
    total = len(messy["good"]) + len(messy["converted"]) + len(messy["broken"])
    assert counts["train"] == tfrecords.Counts(read=total, written=total - len(messy["broken"]),
                                               errors=len(messy["broken"]))
    assert (out / "labels.txt").read_text() == "daisy\nroses\ntulips\n"
    assert sorted(p.name for p in out.glob("train-*")) == ["train-00000-of-00001"]
    labels = {r["image/class/text"].decode(): r["image/class/label"] for r in _records(str(out / "train-*"))}
    assert labels == {"daisy": 0, "roses": 1, "tulips": 2}


def test_a_class_folder_without_images_is_named_in_a_warning(messy, tmp_path, capsys):
    """Labels come from the images' folders, so an empty one is no label: the run says so, not silently."""
    photos = tmp_path / "photos"
    for name in ("daisy", "roses", "tulips"):
        (photos / name).mkdir(parents=True)
    (photos / "daisy" / "a.jpg").write_bytes(next(iter(messy["good"].values())))
    assert tfrecords.main(["--train", str(photos), "--output_dir", str(tmp_path / "o")]) == 0
    assert (f"petal tfrecords: warning: roses, tulips in {photos} hold no images, so they are no labels; "
            "the labels are daisy") in capsys.readouterr().err
    assert (tmp_path / "o" / "labels.txt").read_text() == "daisy\n"


def test_bad_flags_are_clear_errors(messy, tmp_path, capsys):
    with pytest.raises(SystemExit) as missing_input:
        tfrecords.main(["--train", str(tmp_path / "nope.csv"), "--output_dir", str(tmp_path / "o")])
    assert missing_input.value.code == 2 and "no such file" in capsys.readouterr().err
    assert tfrecords.main(["--train", messy["csv"], "--labels_file", messy["labels_file"],
                           "--output_dir", str(tmp_path / "o"), "--runner", "NoSuchRunner"]) == 2
    assert "NoSuchRunner" in capsys.readouterr().err



def test_a_folder_without_class_folders_is_refused_before_any_shard_is_written(messy, tmp_path, capsys):
    """Its photos were neither read nor listed as errors: the job wrote empty shards with exit 0, which training
    then repeated for ever."""
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "daisy.jpg").write_bytes(b"\xff\xd8 a photo not in a class folder")
    assert tfrecords.main(["--train", str(loose), "--labels_file", messy["labels_file"],
                           "--output_dir", str(tmp_path / "o")]) == 2
    assert f"{loose} has no images in class folders ({loose}/<label>/<image>)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
