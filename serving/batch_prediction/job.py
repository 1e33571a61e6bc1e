"""`petal batch`: score many images with an exported model as an Apache Beam job (docs/protocols.md, 'Batch output').

Online serving answers single images; bulk scoring is a batch job, and on a TPU it needs fixed-size batches.
The pipeline reads and keys every input, decodes it on the host with the shared preprocessing, runs the
model on static padded batches (serving/batch_prediction/steps.py, through model_handler.py) and writes sharded JSON
Lines. Nothing is dropped: a bad record becomes an error line with its reason, and the job checks that rows in =
results + errors. Every file, the model's, the inputs and the outputs, is read and written through Petal's storage
layer (exported_models/storage.py), not Beam's file systems, so a job reads and writes the stores the server and
the Spark job do, configured alike.

Beam pipeline options (--runner, --project, --region, --temp_location, --direct_num_workers,
--direct_running_mode, ...) pass straight through, so the same job runs on the DirectRunner, Dataflow, Flink
or Spark. `--engine=spark` runs the same records through the same steps as a plain Spark job instead
(serving/batch_prediction/spark_job.py).
"""
from __future__ import annotations

import argparse
import logging
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import nullcontext
from typing import IO, Any, cast

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.ml.inference.base import KeyedModelHandler, RunInference
from apache_beam.options.pipeline_options import PipelineOptions, PortableOptions, StandardOptions
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from exported_models import storage
from serving import tensorflow_logs
from serving.batch_prediction import preflight, steps
from serving.batch_prediction.cli import (
    SPARK_ONLY_FLAGS,
    CtrlC,
    add_job_flags,
    check_job_flags,
    quiet,
    run_and_report,
    stopped_by_ctrl_c,
)
from serving.batch_prediction.model_handler import METRICS_NAMESPACE, SavedModelHandler
from serving.batch_prediction.sources import FAILED, ReadRecords
from serving.batch_prediction.steps import ERRORS_PREFIX, RESULTS_PREFIX, TEMPORARY, Failure, ModelInfo
from training import PROGRESS_LOGGER

logger = logging.getLogger(__name__)

ERRORS = "errors"
WORK_STAMPS = "work_ms"
_work_stamps = Metrics.distribution(METRICS_NAMESPACE, WORK_STAMPS)  # updates go to the running step's container
# Beam workers log at INFO on their own stderr, and warn about their own plumbing on every start; keep them to
# errors (progress still shows, see parse_args) unless -v asked for more.
QUIET_WORKER_LOG_LEVEL = "ERROR"
DEFAULT_FORMAT_BELOW_ERROR = re.compile(rb"(DEBUG|INFO|WARNING):[\w.]+:")  # logging.BASIC_FORMAT's prefix


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="petal batch", description=__doc__.split("\n\n")[0],
        epilog="Unknown flags are Beam pipeline options, e.g. --runner DataflowRunner --project P --region R "
               "--temp_location gs://B/tmp, or --direct_running_mode multi_processing --direct_num_workers 2. "
               "Spark's own flags: petal batch --engine=spark --help.")
    add_job_flags(parser)
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, PipelineOptions]:
    parser = build_parser()
    args, beam_args = parser.parse_known_args(argv)
    spark_only = [flag for flag in (a.split("=", 1)[0] for a in beam_args) if flag in SPARK_ONLY_FLAGS]
    if spark_only:
        parser.error(f"{', '.join(spark_only)}: the Spark job's, not Beam's; add --engine=spark")
    check_job_flags(parser, args)
    if quiet() and not any(a.startswith("--default_sdk_harness_log_level") for a in beam_args):
        beam_args.append(f"--default_sdk_harness_log_level={QUIET_WORKER_LOG_LEVEL}")
        beam_args.append(f'--sdk_harness_log_level_overrides={{"{PROGRESS_LOGGER}": "INFO"}}')
    return args, PipelineOptions(beam_args)


def shown_quiet(line: bytes, level: int) -> bool:
    """Whether a quiet job shows a line written to its stderr, which local Beam worker processes
    (`--direct_running_mode multi_processing`) inherit. Not what a worker writes as it starts, before its logs go to
    the job through Beam's logging channel: Python's default format below ERROR (Beam's warnings on import about
    Google Cloud clients it lacks, which the driver silences on its own import (cli.py), and "Logging handler
    created"), and TensorFlow's C++ lines below TF_CPP_MIN_LOG_LEVEL `level`."""
    return not DEFAULT_FORMAT_BELOW_ERROR.match(line) and tensorflow_logs.shown(line, level)


def stamp_work() -> None:
    """Records the wall clock in a distribution: its min (first decode) and max (last row out) bound the
    processing time across all workers, so throughput can be reported without the workers' start-up."""
    _work_stamps.update(int(time.time() * 1000))


class DecodeImages(beam.DoFn):
    """`(key, bytes)` to `(key, float32 [H, W, 3] in [-1, 1])`, on the host, exactly as the server does it (any
    other SavedModel: `(key, payload)` to the row its signature takes)."""

    def __init__(self, info: ModelInfo, max_image_pixels: int):
        self._info = info
        self._max_image_pixels = max_image_pixels

    def setup(self) -> None:
        self._decode = steps.make_decoder(self._info, self._max_image_pixels)

    def process(self, record: tuple[Any, bytes]) -> Iterator[Any]:
        stamp_work()
        decoded = self._decode(*record)
        yield beam.pvalue.TaggedOutput(FAILED, decoded) if isinstance(decoded, Failure) else decoded


class FormatRows(beam.DoFn):
    """Predictions and failures to JSON lines, counted (the model's step logs the progress: model_handler.py)."""

    def __init__(self, info: ModelInfo, top_k: int):
        self._info = info
        self._top_k = top_k

    def process(self, element: Any) -> Iterator[Any]:
        is_result, line = ((False, element.to_json()) if isinstance(element, Failure)
                           else steps.result_line(*cast(tuple[Any, Any], element), self._info, self._top_k))
        Metrics.counter(METRICS_NAMESPACE, "predicted" if is_result else "failed").inc()
        yield line if is_result else beam.pvalue.TaggedOutput(ERRORS, line)
        stamp_work()


class WriteParts(beam.DoFn):
    """Each bundle's lines to a part file of its own in the output's _temporary/ folder, named downstream once the
    bundle is done: a bundle that fails and is run again leaves a part that nothing names, so every line is
    committed once (commit_parts)."""

    def __init__(self, folder: str, prefix: str):
        self._folder = folder
        self._prefix = prefix

    def start_bundle(self) -> None:
        self._path = ""
        self._file: IO[bytes] | None = None

    def process(self, line: str) -> None:
        if self._file is None:
            self._path = storage.join(self._folder, f"{self._prefix}-{uuid.uuid4().hex}")
            self._file = storage.open_file(self._path, "wb")
        self._file.write(line.encode() + b"\n")

    def finish_bundle(self) -> Iterator[WindowedValue]:
        if self._file is not None:
            self._file.close()
            yield WindowedValue(self._path, GlobalWindow().max_timestamp(), (GlobalWindow(),))


def commit_parts(parts: list[str], output_dir: str, prefix: str, one_file: bool) -> None:
    """The finished parts under their final names: one shard each, or joined into `<prefix>-00000-of-00001`."""
    if one_file:
        steps.join_files(sorted(parts), storage.join(output_dir, f"{prefix}-00000-of-00001"))
    else:
        steps.commit_shards(sorted(parts), output_dir, prefix)


class WriteLines(beam.PTransform):
    """Lines to `<output_dir>/<prefix>-*` through the storage layer, on any store: as many shards as bundles wrote
    them, or one file."""

    def __init__(self, output_dir: str, prefix: str, one_file: bool = False):
        super().__init__()
        self._output_dir = output_dir
        self._prefix = prefix
        self._one_file = one_file

    def expand(self, lines: beam.PCollection) -> beam.PCollection:
        temporary = storage.join(self._output_dir, TEMPORARY)
        return (lines | "WriteParts" >> beam.ParDo(WriteParts(temporary, self._prefix))
                | "GatherParts" >> beam.combiners.ToList()
                | "Commit" >> beam.Map(commit_parts, self._output_dir, self._prefix, self._one_file))


def build_pipeline(pipeline: beam.Pipeline, args: argparse.Namespace, info: ModelInfo) -> None:
    """read -> decode on the host -> RunInference on static batches -> sharded JSON Lines."""
    records, read_failures = pipeline | "Read" >> ReadRecords(args.input, args.input_format, info.mode)
    decoded = records | "Decode" >> beam.ParDo(DecodeImages(info, args.max_image_pixels)).with_outputs(
        FAILED, main="images")
    handler: KeyedModelHandler[Any, Any, Any, Any] = KeyedModelHandler(
        SavedModelHandler(info, args.batch_size, args.use_tpu, args.tpu))
    predictions = decoded.images | "Predict" >> RunInference(handler)
    rows = ((predictions, read_failures, decoded[FAILED]) | "Gather" >> beam.Flatten()
            | "Format" >> beam.ParDo(FormatRows(info, args.top_k)).with_outputs(ERRORS, main="results"))
    output = args.output_dir.rstrip("/")
    rows.results | "WriteResults" >> WriteLines(output, RESULTS_PREFIX)
    rows[ERRORS] | "WriteErrors" >> WriteLines(output, ERRORS_PREFIX, one_file=True)


def check_workers_read_the_model(model_dir: str, options: PipelineOptions) -> None:
    """Refuses a model in a local folder when the runner's workers run on other machines (Dataflow, Flink, Spark,
    a portable job service not in LOOPBACK mode), where they could not read it.

    Refusing rather than shipping: Beam stages files for such workers only into a folder each runner chooses
    (--files_to_stage), which a DoFn cannot find portably, and those workers read their inputs and outputs from a
    shared filesystem anyway, where the model belongs too (docs/batch.md, 'On a cluster')."""
    runner = options.view_as(StandardOptions).runner or "DirectRunner"
    name = runner.rsplit(".", 1)[-1] if isinstance(runner, str) else type(runner).__name__  # a class path too
    local = {n.lower() for n in StandardOptions.LOCAL_RUNNERS}
    on_this_machine = (name.lower() in local or f"{name.lower()}runner" in local
                       or options.view_as(PortableOptions).environment_type == "LOOPBACK")
    if not on_this_machine and not steps.shared_path(model_dir):
        raise preflight.CannotStart(
            f"--model_dir {model_dir} is a folder on this machine, which the {name}'s workers cannot read: use a "
            "path every worker can read: s3://…, gs://…, az://…, hdfs://…, or file:///… for a folder every worker "
            "mounts")


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
    """Runs the job to completion and returns the summary; `complete` says rows in = results + errors. What the
    driver can check (preflight) fails before the pipeline starts."""
    check_workers_read_the_model(args.model_dir, options)
    info = preflight.load_model(args)
    preflight.check_inputs(args.input, args.input_format)
    preflight.check_output_dir(args.output_dir, args.overwrite)
    temporary = storage.join(args.output_dir, TEMPORARY)
    storage.makedirs(temporary)
    logger.info("batch job starting", extra={"fields": {
        "model": info.path, "input": args.input, "format": args.input_format, "output_dir": args.output_dir,
        "batch_size": args.batch_size}})
    started = time.monotonic()
    pipeline = beam.Pipeline(options=options)
    build_pipeline(pipeline, args, info)
    level = tensorflow_logs.min_log_level()
    # the worker processes get a Ctrl-C too: their tracebacks are not shown
    with CtrlC() as interrupted, \
            tensorflow_logs.stderr_filtered(lambda line: not interrupted.is_set() and shown_quiet(line, level)) \
            if quiet() else nullcontext(), stopped_by_ctrl_c(interrupted):
        result = pipeline.run()
        result.wait_until_finish()
    storage.remove_tree(temporary)
    seconds = time.monotonic() - started
    totals, processing = job_metrics(result)
    counts = steps.Counts(**{name: totals.get(name, 0) for name in steps.Counts.__dataclass_fields__})
    return steps.summary(info, args.output_dir, counts, seconds, processing)


def main(argv: list[str]) -> int:
    args, options = parse_args(argv)
    return run_and_report(lambda: run(args, options), args.output_dir)
