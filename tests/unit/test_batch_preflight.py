"""The batch driver's checks and its TFRecord reader, engine-free: paths made absolute, an unwritable output folder
refused, and every byte of a TFRecord file accounted for (a corrupt middle record, a missing file)."""
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


def _touch(path: str) -> None:
    tf.io.gfile.makedirs(os.path.dirname(path))
    with tf.io.gfile.GFile(path, "w") as f:
        f.write("")


def test_an_output_folder_that_cannot_be_written_is_refused_and_a_good_one_is_left_empty(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(preflight.CannotStart, match=r"--output_dir .*a-file/out cannot be written: "):
        preflight.check_output_dir(str(tmp_path / "a-file" / "out"), False, tf.io.gfile.glob,
                                   lambda paths: [tf.io.gfile.remove(p) for p in paths], _touch)
    preflight.check_output_dir(str(tmp_path / "out"), False, tf.io.gfile.glob,
                               lambda paths: [tf.io.gfile.remove(p) for p in paths], _touch)
    assert os.listdir(tmp_path / "out") == []


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
