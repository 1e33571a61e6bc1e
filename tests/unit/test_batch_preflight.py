"""The batch driver's checks and its files, engine-free: paths made absolute, an unwritable or used output folder
refused (--overwrite deleting an earlier run's files only), parts committed under their final names, and every
byte of a TFRecord file accounted for (a corrupt middle record, a missing file)."""
from __future__ import annotations

import argparse
import os

import pytest
import tensorflow as tf

from serving.batch_prediction import preflight, steps


def test_local_paths_become_absolute_and_urls_stay_as_they_are(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/someone")
    args = argparse.Namespace(model_dir="models/flowers", input="~/photos/*.jpg", output_dir="gs://b/out")
    preflight.resolve_paths(args)
    assert vars(args) == {"model_dir": str(tmp_path / "models" / "flowers"), "input": "/home/someone/photos/*.jpg",
                          "output_dir": "gs://b/out"}
    for url in ("hdfs://nn/models/flowers", "file:///shared/models/flowers", "s3://b/x/*.tfrecord"):
        assert preflight.absolute(url) == url


def test_an_output_folder_that_cannot_be_written_is_refused_and_a_good_one_is_left_empty(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(preflight.CannotStart, match=r"--output_dir .*a-file/out cannot be written: "):
        preflight.check_output_dir(str(tmp_path / "a-file" / "out"), False)
    preflight.check_output_dir(str(tmp_path / "out"), False)
    assert os.listdir(tmp_path / "out") == []


def test_a_used_output_folder_is_refused_and_overwrite_deletes_an_earlier_runs_files_only(tmp_path):
    out = tmp_path / "out"
    (out / steps.TEMPORARY).mkdir(parents=True)
    (out / steps.TEMPORARY / "attempt-00000-7.results").write_text("{}\n")
    (out / "prediction.results-00000-of-00001").write_text("{}\n")
    (out / steps.ERRORS_FILE).write_text("")
    (out / "notes.txt").write_text("mine\n")
    with pytest.raises(FileExistsError, match=r"--output_dir .*/out is not empty \(4 files\); .* --overwrite"):
        preflight.check_output_dir(str(out), False)
    assert len(list(out.rglob("*"))) == 5
    preflight.check_output_dir(str(out), True)
    assert os.listdir(out) == ["notes.txt"]


def test_parts_are_committed_under_their_final_names(tmp_path):
    parts = []
    for index, line in enumerate(["a", "b"]):
        parts.append(str(tmp_path / f"part-{index}"))
        (tmp_path / f"part-{index}").write_text(f"{line}\n")
    steps.join_files(parts, str(tmp_path / "joined"))
    assert (tmp_path / "joined").read_text() == "a\nb\n" and not (tmp_path / "joined.tmp").exists()
    (tmp_path / "out").mkdir()
    steps.commit_shards(parts, str(tmp_path / "out"), "x")
    assert {name: (tmp_path / "out" / name).read_text() for name in os.listdir(tmp_path / "out")} == {
        "x-00000-of-00002": "a\n", "x-00001-of-00002": "b\n"}
    assert not [p for p in parts if os.path.exists(p)]
    steps.commit_shards([], str(tmp_path / "out"), "y")  # no part: one empty shard says so
    assert (tmp_path / "out" / "y-00000-of-00001").read_text() == ""


def _records(path: str, count: int) -> list[bytes]:
    examples = [tf.train.Example(features=tf.train.Features(feature={"key": tf.train.Feature(
        bytes_list=tf.train.BytesList(value=[f"r{i}".encode()]))})).SerializeToString() for i in range(count)]
    with tf.io.TFRecordWriter(path) as writer:
        for example in examples:
            writer.write(example)
    return examples


def test_a_corrupt_record_in_the_middle_is_one_error_at_its_byte_offset(tmp_path):
    path = str(tmp_path / "x.tfrecord")
    examples = _records(path, 4)
    data = bytearray(open(path, "rb").read())
    start = len(examples[0]) + 16  # the second record: 16 bytes of framing around each
    data[start + 12 + 1] ^= 0xFF  # a byte of its data: its CRC no longer matches
    open(path, "wb").write(bytes(data))
    items = list(steps.read_tfrecord_file(path, "classify"))
    assert items[0] == ("r0", examples[0])
    (failure,) = items[1:]
    assert (failure.key, failure.status) == (f"{path}:1", "DATA_LOSS")
    assert f"{path}: byte {start} of {len(data)} does not start a whole TFRecord (after record 0)" in failure.message


def test_a_whole_file_has_no_error_and_a_missing_one_is_one(tmp_path):
    path = str(tmp_path / "x.tfrecord")
    examples = _records(path, 3)
    assert list(steps.read_tfrecord_file(path, "classify")) == [(f"r{i}", e) for i, e in enumerate(examples)]
    (failure,) = steps.read_tfrecord_file(str(tmp_path / "gone.tfrecord"))
    assert (failure.key, failure.status) == (f"{tmp_path}/gone.tfrecord:0", "NOT_FOUND")


def test_an_integer_key_keys_its_record_and_two_images_in_one_are_an_error(tmp_path):
    """An int64 `key` was passed over for the record's position, and a second image/encoded value was dropped."""
    def example(**features: tf.train.Feature) -> bytes:
        return tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()

    def images(*values: bytes) -> tf.train.Feature:
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=list(values)))

    path = str(tmp_path / "x.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        writer.write(example(key=tf.train.Feature(int64_list=tf.train.Int64List(value=[1234])),
                             **{"image/encoded": images(b"one")}))
        writer.write(example(**{"image/filename": images(b"two.jpg"), "image/encoded": images(b"a", b"b")}))
    first, second = steps.read_tfrecord_file(path)
    assert first == (1234, b"one")
    assert second == steps.Failure("two.jpg", "INVALID_ARGUMENT",
                                   "tf.train.Example has 2 images in image/encoded; a record holds one")
