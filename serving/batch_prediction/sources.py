"""Reading and keying the four batch-job input formats as Beam transforms, without ever losing a record.

The reading and keying itself is serving/batch_prediction/steps.py's, shared with the Spark job (every file read
through Petal's storage layer, on any store); these DoFns only count each input and route failures to their own
output.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics

from serving.batch_prediction import steps
from serving.batch_prediction.model_handler import METRICS_NAMESPACE
from serving.batch_prediction.steps import FORMATS, Failure

FAILED = "failed"


def _counted(item: steps.Record | Failure) -> Any:
    """One input read: counted, and a failure tagged for the errors output."""
    Metrics.counter(METRICS_NAMESPACE, "read").inc()
    return beam.pvalue.TaggedOutput(FAILED, item) if isinstance(item, Failure) else item


class ReadFiles(beam.DoFn):
    """A path to `(path, bytes)`; a file that cannot be read becomes a failure keyed by its path."""

    def process(self, path: str) -> Iterator[Any]:
        yield _counted(steps.read_file(path))


class ReadTFRecordFile(beam.DoFn):
    """Every tf.train.Example in one TFRecord file to `(key, image/encoded)` (other modes: the example)."""

    def __init__(self, mode: str):
        self._mode = mode

    def process(self, path: str) -> Iterator[Any]:
        for item in steps.read_tfrecord_file(path, self._mode):
            yield _counted(item)


class ReadJsonLinesFile(beam.DoFn):
    """Every `{"key": …, "image_bytes": {"b64": …}}` line of one file to `(key, bytes)` (other modes: their
    payloads)."""

    def __init__(self, mode: str):
        self._mode = mode

    def process(self, path: str) -> Iterator[Any]:
        for item in steps.read_jsonl_file(path, self._mode):
            yield _counted(item)


class ReadRecords(beam.PTransform):
    """A pattern in one of FORMATS to a pair of PCollections: `(key, bytes)` records and `Failure`s.

    The work is spread with a Reshuffle at the cheapest point: before reading for path-based formats (paths
    are small), after reading for record files (one file may hold many images).
    """

    def __init__(self, pattern: str, input_format: str, mode: str = steps.IMAGES):
        super().__init__()
        if input_format not in FORMATS:
            raise ValueError(f"--input_format must be one of {', '.join(FORMATS)}, got {input_format!r}")
        self._pattern = pattern
        self._format = input_format
        self._mode = mode

    def expand(self, pbegin: beam.pvalue.PBegin) -> tuple[beam.PCollection, beam.PCollection]:
        paths = pbegin | "Pattern" >> beam.Create([self._pattern]) | "Match" >> beam.FlatMap(steps.list_files)
        if self._format == "filelist":  # a path of each line: relative to its list, so that lists travel
            paths = paths | "ReadList" >> beam.FlatMap(steps.read_file_list)
        if self._format in ("images", "filelist"):
            outputs = (paths | "SpreadPaths" >> beam.Reshuffle()
                       | "ReadFiles" >> beam.ParDo(ReadFiles()).with_outputs(FAILED, main="records"))
            return outputs.records, outputs[FAILED]
        reader = ReadTFRecordFile(self._mode) if self._format == "tfrecord" else ReadJsonLinesFile(self._mode)
        outputs = paths | "ReadRecords" >> beam.ParDo(reader).with_outputs(FAILED, main="records")
        return outputs.records | "SpreadRecords" >> beam.Reshuffle(), outputs[FAILED]
