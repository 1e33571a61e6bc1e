"""`petal batch`: score many images with an exported model as an Apache Beam job (SPEC §7).

Online serving answers single images; bulk scoring is a batch job, and on a TPU it needs fixed-size batches.
The pipeline reads and keys every input, decodes it on the host with the shared preprocessing, runs the
model on static padded batches (serving/model_handler.py) and writes sharded JSON Lines. Nothing is dropped:
a bad record becomes an error line with its reason, and the job checks that rows in = results + errors.

Beam pipeline options (--runner, --project, --region, --temp_location, --direct_num_workers,
--direct_running_mode, ...) pass straight through, so the same job runs on the DirectRunner, Dataflow, Flink
or Spark.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
import numpy as np
import tensorflow as tf
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.ml.inference.base import KeyedModelHandler, RunInference
from apache_beam.options.pipeline_options import PipelineOptions

from serving.batch.sources import FAILED, FORMATS, Failure, ReadRecords, infer_format
from serving.core.errors import op_error_message
from serving.batch.model_handler import METRICS_NAMESPACE, ModelInfo, SavedModelHandler, read_model_info
from training import PROGRESS_LOGGER
from training.preprocessing import preprocess_eval

logger = logging.getLogger(__name__)
progress = logging.getLogger(PROGRESS_LOGGER)  # INFO even when quiet: see petal.configure_logging

RESULTS_PREFIX = "prediction.results"
ERRORS_PREFIX = "prediction.errors_stats"
ERRORS = "errors"
WORK_STAMPS = "work_ms"
_work_stamps = Metrics.distribution(METRICS_NAMESPACE, WORK_STAMPS)  # updates go to the running step's container
PROGRESS_SECONDS = 10.0
# Beam workers log at INFO on their own stderr, and warn about their own plumbing on every start; keep them to
# errors (progress still shows, see parse_args) unless -v asked for more.
QUIET_WORKER_LOG_LEVEL = "ERROR"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="petal batch", description=__doc__.split("\n\n")[0],
        epilog="Unknown flags are Beam pipeline options, e.g. --runner DataflowRunner --project P --region R "
               "--temp_location gs://B/tmp, or --direct_running_mode multi_processing --direct_num_workers 2.")
    parser.add_argument("--model_dir", required=True,
                        help="a SavedModel version directory, or a base path (its latest version is used)")
    parser.add_argument("--input", required=True, help="file pattern of the inputs (local path or gs://...)")
    parser.add_argument("--input_format", choices=FORMATS,
                        help="inferred from the pattern's extension when omitted: .tfrecord(s)/.tfr, "
                             ".jsonl/.json, .txt/.lst/.list (file list), anything else image files")
    parser.add_argument("--output_dir", required=True, help="where prediction.* shards are written")
    parser.add_argument("--batch_size", type=int, default=64,
                        help="rows per model call, fixed; a multiple of the replica count")
    parser.add_argument("--top_k", type=int, default=0, help="also write the k best labels with their scores")
    parser.add_argument("--tpu", default=None, help="TPU name or grpc:// address; implies --use_tpu")
    parser.add_argument("--use_tpu", action="store_true", help="run inference under TPUStrategy")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the prediction.* shards of an earlier run instead of refusing")
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, PipelineOptions]:
    parser = build_parser()
    args, beam_args = parser.parse_known_args(argv)
    if args.batch_size < 1:
        parser.error("--batch_size must be at least 1")
    if args.top_k < 0:
        parser.error("--top_k must not be negative")
    args.input_format = args.input_format or infer_format(args.input)
    quiet = logging.getLogger().getEffectiveLevel() > logging.INFO
    if quiet and not any(a.startswith("--default_sdk_harness_log_level") for a in beam_args):
        beam_args.append(f"--default_sdk_harness_log_level={QUIET_WORKER_LOG_LEVEL}")
        beam_args.append(f'--sdk_harness_log_level_overrides={{"{progress.name}": "INFO"}}')
    return args, PipelineOptions(beam_args)


def stamp_work() -> None:
    """Records the wall clock in a distribution: its min (first decode) and max (last row out) bound the
    processing time across all workers, so throughput can be reported without the workers' start-up."""
    _work_stamps.update(int(time.time() * 1000))


class DecodeImages(beam.DoFn):
    """`(key, bytes)` to `(key, float32 [H, W, 3] in [-1, 1])`, on the host, exactly as the server does it."""

    def __init__(self, height: int, width: int):
        self._size = (height, width)

    def setup(self) -> None:
        height, width = self._size
        self._decode = tf.function(lambda data: preprocess_eval(data, height, width),
                                   input_signature=[tf.TensorSpec([], tf.string)])

    def process(self, record: tuple[Any, bytes]) -> Iterator[Any]:
        stamp_work()
        key, data = record
        try:
            yield key, self._decode(data).numpy()
        except tf.errors.InvalidArgumentError as e:
            yield beam.pvalue.TaggedOutput(
                FAILED, Failure(key, "INVALID_ARGUMENT", f"cannot decode image: {op_error_message(e.message)}"))


def prediction_row(key: Any, prediction: dict[str, np.ndarray], labels: tuple[str, ...], top_k: int) -> dict:
    """One results line; `top_k` adds the best labels in the classify_image response's shape."""
    probabilities = prediction["probabilities"]
    row = {"class": str(prediction["class"]), "classid": int(prediction["classid"]),
           "probabilities": [float(p) for p in probabilities]}
    if top_k:
        best = np.argsort(-probabilities, kind="stable")[:top_k]
        row["top_k"] = [{"label": labels[i], "score": float(probabilities[i])} for i in best]
    return {"key": key, "prediction": row}


class FormatRows(beam.DoFn):
    """Predictions and failures to JSON lines, counted; each worker logs its progress now and then."""

    def __init__(self, labels: tuple[str, ...], top_k: int):
        self._labels = labels
        self._top_k = top_k

    def setup(self) -> None:
        self._done = 0
        self._started = self._logged = time.monotonic()

    def process(self, element: Any) -> Iterator[Any]:
        if isinstance(element, Failure):
            Metrics.counter(METRICS_NAMESPACE, "failed").inc()
            yield beam.pvalue.TaggedOutput(ERRORS, element.to_json())
        else:
            Metrics.counter(METRICS_NAMESPACE, "predicted").inc()
            yield json.dumps(prediction_row(*element, self._labels, self._top_k))
        stamp_work()
        self._done += 1
        now = time.monotonic()
        if now - self._logged >= PROGRESS_SECONDS:
            self._logged = now
            progress.info("batch progress", extra={"fields": {
                "rows_done": self._done, "images_per_s": round(self._done / (now - self._started), 1)}})


def build_pipeline(pipeline: beam.Pipeline, args: argparse.Namespace, info: ModelInfo) -> None:
    """read -> decode on the host -> RunInference on static batches -> sharded JSON Lines."""
    records, read_failures = pipeline | "Read" >> ReadRecords(args.input, args.input_format)
    decoded = records | "Decode" >> beam.ParDo(DecodeImages(info.height, info.width)).with_outputs(
        FAILED, main="images")
    handler = KeyedModelHandler(SavedModelHandler(info, args.batch_size, args.use_tpu or args.tpu is not None,
                                                  args.tpu))
    predictions = decoded.images | "Predict" >> RunInference(handler)
    rows = ((predictions, read_failures, decoded[FAILED]) | "Gather" >> beam.Flatten()
            | "Format" >> beam.ParDo(FormatRows(info.labels, args.top_k)).with_outputs(ERRORS, main="results"))
    output = args.output_dir.rstrip("/")
    rows.results | "WriteResults" >> beam.io.WriteToText(FileSystems.join(output, RESULTS_PREFIX))
    rows[ERRORS] | "WriteErrors" >> beam.io.WriteToText(FileSystems.join(output, ERRORS_PREFIX), num_shards=1)


def prepare_output_dir(output_dir: str, overwrite: bool) -> None:
    """Never mix two runs' shards: refuse a non-empty directory, or with --overwrite delete the old shards."""
    existing = [m.path for m in FileSystems.match([FileSystems.join(output_dir.rstrip("/"), "*")])[0].metadata_list]
    if not existing:
        return
    if not overwrite:
        raise FileExistsError(f"--output_dir {output_dir} is not empty ({len(existing)} entries); "
                              "choose a new directory or pass --overwrite")
    old = [p for p in existing if p.rsplit("/", 1)[-1].startswith((RESULTS_PREFIX, ERRORS_PREFIX))]
    if old:
        FileSystems.delete(old)


def check_inputs(pattern: str, input_format: str) -> None:
    """Fail before launching workers when the pattern matches nothing (a typo would otherwise 'succeed')."""
    if not FileSystems.match([pattern])[0].metadata_list:
        raise FileNotFoundError(f"--input {pattern} matches no files (format {input_format})")


def job_metrics(result: beam.runners.runner.PipelineResult) -> tuple[dict[str, int], float]:
    """The job's counters, summed over steps, and its processing seconds (first decode to last row)."""
    query = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))
    totals: dict[str, int] = {}
    for counter in query["counters"]:
        totals[counter.key.metric.name] = totals.get(counter.key.metric.name, 0) + (counter.committed or 0)
    stamps = [d.committed for d in query["distributions"]
              if d.key.metric.name == WORK_STAMPS and d.committed and d.committed.count]
    span_ms = max(d.max for d in stamps) - min(d.min for d in stamps) if stamps else 0
    return totals, span_ms / 1000


def run(args: argparse.Namespace, options: PipelineOptions) -> dict[str, Any]:
    """Runs the job to completion and returns the summary; `complete` says rows in = results + errors."""
    info = read_model_info(args.model_dir)
    check_inputs(args.input, args.input_format)
    prepare_output_dir(args.output_dir, args.overwrite)
    logger.info("batch job starting", extra={"fields": {
        "model": info.path, "input": args.input, "format": args.input_format, "output_dir": args.output_dir,
        "batch_size": args.batch_size}})
    started = time.monotonic()
    pipeline = beam.Pipeline(options=options)
    build_pipeline(pipeline, args, info)
    result = pipeline.run()
    result.wait_until_finish()
    seconds = time.monotonic() - started
    totals, processing = job_metrics(result)
    read, predicted, failed = (totals.get(name, 0) for name in ("read", "predicted", "failed"))
    return {"model": info.path, "output_dir": args.output_dir, "rows_in": read, "results": predicted,
            "errors": failed, "complete": read == predicted + failed, "batches": totals.get("batches", 0),
            "padding_rows": totals.get("padded", 0), "seconds": round(seconds, 2),
            "processing_seconds": round(processing, 2),
            "images_per_s": round(predicted / processing, 1) if processing else 0.0}


def main(argv: list[str]) -> int:
    args, options = parse_args(argv)
    try:
        summary = run(args, options)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"petal batch: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    if not summary["complete"]:
        logger.error("rows lost: rows in != results + errors", extra={"fields": summary})
        return 1
    return 0
