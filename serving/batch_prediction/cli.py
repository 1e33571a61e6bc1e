"""`petal batch`: the flags both engines take, and the choice of engine (Beam by default, or Spark).

Each engine parses its own flags on top of these, so Beam's pipeline options and Spark's settings never meet,
and only the chosen engine's package is imported. Local paths become absolute here, on the driver, before any
worker sees them (serving/batch_prediction/preflight.py).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable
from typing import Any

from serving.batch_prediction import preflight, steps
from serving.config import DataPlaneOptions

ENGINES = {"beam": ("serving.batch_prediction.job", "apache_beam", "batch"),
           "spark": ("serving.batch_prediction.spark_job", "pyspark", "spark")}
# The flags only the Spark job takes (spark_job.build_parser): given to the Beam job, they are refused rather than
# passed to Beam as pipeline options, which it discards with a warning.
SPARK_ONLY_FLAGS = ("--spark_master", "--rows_per_partition", "--spark_event_log_dir", "--spark_conf")


def add_job_flags(parser: argparse.ArgumentParser) -> None:
    # Imported here, on the driver: Beam's workers import this module with the job's steps (job.py), and an image
    # job's workers need none of the any-model stack (docs/batch.md, 'Lean workers').
    from serving.batch_prediction import any_model

    parser.add_argument("--engine", choices=sorted(ENGINES), default="beam",
                        help="Apache Beam (the default: DirectRunner, Dataflow, ...) or Apache Spark")
    parser.add_argument("--model_dir", required=True,
                        help="a SavedModel version directory, or a base path (its latest version is used)")
    parser.add_argument("--input", required=True, help="file pattern of the inputs (local path or gs://...)")
    parser.add_argument("--input_format", choices=steps.FORMATS,
                        help="inferred from the pattern's extension when omitted: .tfrecord(s)/.tfr, "
                             ".jsonl/.json, .txt/.lst/.list (file list), anything else image files")
    parser.add_argument("--signature_name", default=None,
                        help="the signature to run: predict_images for Petal's image classifiers, else "
                             "serving_default")
    parser.add_argument("--method", choices=any_model.METHODS, default=None,
                        help="predict, classify or regress; by default the signature's method name, else its "
                             "structure as TF Serving reads it (one DT_STRING 'inputs' to classes/scores or "
                             "outputs: tf.Examples), else predict")
    parser.add_argument("--output_dir", required=True, help="where prediction.* shards are written")
    parser.add_argument("--batch_size", type=int, default=64,
                        help="rows per model call, fixed; a multiple of the replica count")
    parser.add_argument("--top_k", type=int, default=0, help="also write the k best labels with their scores")
    parser.add_argument("--max_image_pixels", type=int, default=DataPlaneOptions.max_image_pixels,
                        help="an image whose header claims more pixels is an error row, never decoded (the "
                             "server's flag and default)")
    parser.add_argument("--tpu", default=None, help="TPU name or grpc:// address; implies --use_tpu")
    parser.add_argument("--use_tpu", action="store_true", help="run inference under TPUStrategy")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the prediction.* shards of an earlier run instead of refusing")


def check_job_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.batch_size < 1:
        parser.error("--batch_size must be at least 1")
    if args.top_k < 0:
        parser.error("--top_k must not be negative")
    if args.max_image_pixels < 1:
        parser.error("--max_image_pixels must be at least 1")
    args.input_format = args.input_format or steps.infer_format(args.input)
    args.use_tpu = args.use_tpu or args.tpu is not None
    preflight.resolve_paths(args)


def run_and_report(run: Callable[[], dict[str, Any]]) -> int:
    """Exit 2, with one line, for a job that cannot start (bad paths, an unreadable model, a used or unwritable
    output directory), 1 for one that lost rows."""
    try:
        job_summary = run()
    except (preflight.CannotStart, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"petal batch: error: {e}", file=sys.stderr)
        return 2
    return steps.report(job_summary)


def quiet() -> bool:
    """Whether the job runs quiet (no -v): Petal's logging at warnings, as petal.configure_logging sets it."""
    return logging.getLogger().getEffectiveLevel() > logging.INFO


def without_beams_memory_notice(record: logging.LogRecord) -> bool:
    """Beam 2.77's RunInference warns on the root logger, at every model load, that it cannot measure memory: it
    imports `resource` in one try block with a module that needs torch, so without torch it gives up on both. The
    job reads no such measure, and the notice is not true of the platform."""
    return not record.getMessage().startswith("Resource module is not available for current platform")


def main(argv: list[str]) -> int:
    logging.getLogger().addFilter(without_beams_memory_notice)
    chooser = argparse.ArgumentParser(add_help=False)
    chooser.add_argument("--engine", choices=sorted(ENGINES), default="beam")
    engine = chooser.parse_known_args(argv)[0].engine
    module_name, package, extra = ENGINES[engine]
    root = logging.getLogger()
    level = root.level
    if quiet():  # Beam warns on import about Google Cloud clients it lacks
        root.setLevel(logging.ERROR)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != package:
            raise
        print(f"petal batch --engine={engine} needs {package}: pip install 'petal[{extra}]'", file=sys.stderr)
        return 2
    finally:
        root.setLevel(level)
    return module.main(argv)
