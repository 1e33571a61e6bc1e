"""Reading and keying the four batch-job input formats (SPEC §7), without ever losing a record.

Every input becomes either a `(key, image_bytes)` record or a `Failure` carrying its key and reason, so that
results + errors always add up to the number of inputs. Keys are what a user can trace back: the file path,
the TFRecord's `key` or `image/filename` feature, or the JSON line's `key`; a record without one is keyed by
`<file>:<index>`.
"""
from __future__ import annotations

import base64
import binascii
import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
import tensorflow as tf
from apache_beam.io import fileio
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from google.protobuf.message import DecodeError
from tensorflow.core.example import example_pb2

from serving.batch.model_handler import METRICS_NAMESPACE

FAILED = "failed"
FORMATS = ("images", "filelist", "tfrecord", "jsonl")
_EXTENSIONS = {".tfrecord": "tfrecord", ".tfrecords": "tfrecord", ".tfr": "tfrecord", ".jsonl": "jsonl",
               ".json": "jsonl", ".txt": "filelist", ".lst": "filelist", ".list": "filelist"}


@dataclass(frozen=True)
class Failure:
    """One input that produced no prediction, with a gRPC status name as TF Serving would report it."""

    key: Any
    status: str
    message: str

    def to_json(self) -> str:
        return json.dumps({"key": self.key, "error": {"status": self.status, "message": self.message}})


def infer_format(pattern: str) -> str:
    """The format a pattern's extension implies; anything unrecognised is taken to be image files."""
    return _EXTENSIONS.get(posixpath.splitext(pattern.rstrip("*"))[1].lower(), "images")


def _read_counter():
    return Metrics.counter(METRICS_NAMESPACE, "read")


def _fail(key: Any, status: str, message: str) -> beam.pvalue.TaggedOutput:
    return beam.pvalue.TaggedOutput(FAILED, Failure(key, status, message))


class ReadFiles(beam.DoFn):
    """A path to `(path, bytes)`; a file that cannot be read becomes a failure keyed by its path."""

    def process(self, path: str) -> Iterator[Any]:
        _read_counter().inc()
        try:
            with FileSystems.open(path) as f:
                yield path, f.read()
        except FileNotFoundError as e:
            yield _fail(path, "NOT_FOUND", f"no such file: {e.filename or path}")
        except IsADirectoryError:
            yield _fail(path, "INVALID_ARGUMENT", "is a directory, not an image file")
        except OSError as e:
            yield _fail(path, "UNAVAILABLE", f"cannot read the file: {e}")


class ParseFileList(beam.DoFn):
    """One line of a file list to a path; relative paths are relative to the list file, so lists travel."""

    def process(self, element: tuple[str, str]) -> Iterator[str]:
        list_file, line = element
        path = line.strip()
        if path:
            yield path if FileSystems.get_scheme(path) or posixpath.isabs(path) else FileSystems.join(
                posixpath.dirname(list_file), path)


class ReadTFRecordFile(beam.DoFn):
    """Every tf.train.Example in one TFRecord file to `(key, image/encoded)`."""

    def process(self, path: str) -> Iterator[Any]:
        index = -1
        try:
            for index, serialized in enumerate(tf.data.TFRecordDataset(path).as_numpy_iterator()):
                _read_counter().inc()
                yield self._record(f"{path}:{index}", serialized)
        except tf.errors.OpError as e:
            _read_counter().inc()
            yield _fail(f"{path}:{index + 1}", "DATA_LOSS", f"unreadable TFRecord data after record {index}: "
                                                            f"{e.message}")

    @staticmethod
    def _record(position: str, serialized: bytes) -> Any:
        example = example_pb2.Example()
        try:
            example.ParseFromString(serialized)
        except DecodeError:
            return _fail(position, "INVALID_ARGUMENT", "record is not a serialized tf.train.Example")
        features = example.features.feature
        key = position
        for name in ("key", "image/filename"):
            values = features[name].bytes_list.value if name in features else ()
            if values:
                key = values[0].decode("utf-8", "replace")
                break
        encoded = features["image/encoded"].bytes_list.value if "image/encoded" in features else []
        if not encoded:
            return _fail(key, "INVALID_ARGUMENT", "tf.train.Example has no image/encoded bytes")
        return key, encoded[0]


class ReadJsonLinesFile(beam.DoFn):
    """Every `{"key": …, "image_bytes": {"b64": …}}` line of one file to `(key, bytes)`."""

    def process(self, path: str) -> Iterator[Any]:
        number = 0
        try:
            with FileSystems.open(path) as f:
                for number, raw in enumerate(f, start=1):
                    if raw.strip():
                        _read_counter().inc()
                        yield self._record(f"{path}:{number}", raw)
        except OSError as e:
            _read_counter().inc()
            yield _fail(f"{path}:{number + 1}", "UNAVAILABLE", f"cannot read the file past line {number}: {e}")

    @staticmethod
    def _record(position: str, raw: bytes) -> Any:
        try:
            row = json.loads(raw)
        except ValueError as e:
            return _fail(position, "INVALID_ARGUMENT", f"line is not valid JSON: {e}")
        if not isinstance(row, dict):
            return _fail(position, "INVALID_ARGUMENT", "line must be a JSON object with key and image_bytes")
        key = row.get("key", position)
        image = row.get("image_bytes")
        if not isinstance(image, dict) or not isinstance(image.get("b64"), str):
            return _fail(key, "INVALID_ARGUMENT", 'image_bytes must be {"b64": "<base64 string>"}')
        try:
            return key, base64.b64decode(image["b64"], validate=True)
        except (binascii.Error, ValueError) as e:
            return _fail(key, "INVALID_ARGUMENT", f"image_bytes.b64 is not valid base64: {e}")


class ReadRecords(beam.PTransform):
    """A pattern in one of FORMATS to a pair of PCollections: `(key, bytes)` records and `Failure`s.

    The work is spread with a Reshuffle at the cheapest point: before reading for path-based formats (paths
    are small), after reading for record files (one file may hold many images).
    """

    def __init__(self, pattern: str, input_format: str):
        super().__init__()
        if input_format not in FORMATS:
            raise ValueError(f"--input_format must be one of {', '.join(FORMATS)}, got {input_format!r}")
        self._pattern = pattern
        self._format = input_format

    def expand(self, pbegin: beam.pvalue.PBegin) -> tuple[beam.PCollection, beam.PCollection]:
        if self._format == "filelist":
            paths = (pbegin | "ReadList" >> beam.io.ReadFromTextWithFilename(self._pattern)
                     | "ParseList" >> beam.ParDo(ParseFileList()))
        else:
            paths = (pbegin | "Match" >> fileio.MatchFiles(self._pattern)
                     | "Paths" >> beam.Map(lambda metadata: metadata.path))
        if self._format in ("images", "filelist"):
            outputs = (paths | "SpreadPaths" >> beam.Reshuffle()
                       | "ReadFiles" >> beam.ParDo(ReadFiles()).with_outputs(FAILED, main="records"))
            return outputs.records, outputs[FAILED]
        reader = ReadTFRecordFile() if self._format == "tfrecord" else ReadJsonLinesFile()
        outputs = paths | "ReadRecords" >> beam.ParDo(reader).with_outputs(FAILED, main="records")
        return outputs.records | "SpreadRecords" >> beam.Reshuffle(), outputs[FAILED]
