"""`petal batch`: the flags both engines take, and the choice of engine (Beam by default, or Spark).

Each engine parses its own flags on top of these, so Beam's pipeline options and Spark's settings never meet,
and only the chosen engine's package is imported. Local paths become absolute here, on the driver, before any
worker sees them (serving/batch_prediction/preflight.py).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from exported_models import storage
from serving.batch_prediction import preflight, steps
from serving.options.config import DataPlaneOptions
from training import import_warnings_hidden

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
                        help="a SavedModel version directory, or a base path (its latest version is used); a local "
                             "path or a URL (s3://, gs://, az://)")
    parser.add_argument("--input", required=True,
                        help="file pattern of the inputs: a local path or a URL (s3://, gs://, az://)")
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
    parser.add_argument("--output_dir", required=True,
                        help="where prediction.* shards are written: a local path or a URL (s3://, gs://, az://)")
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


def run_and_report(run: Callable[[], dict[str, Any]], output_dir: str) -> int:
    """Exit 2, with one line, for a job that cannot start (bad paths, an unreadable model, a used or unwritable
    output directory), 1 for one that lost rows or whose store failed it once started, 130 (as a shell reports
    SIGINT) for one stopped by Ctrl-C, whose traceback through the engine's threads was a screenful that said less
    than one line: what the Ctrl-C left."""
    try:
        job_summary = run()
    except (preflight.CannotStart, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"petal batch: error: {e}", file=sys.stderr)
        return 2
    except storage.StorageError as e:
        print(f"petal batch: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"petal batch: interrupted: --output_dir {output_dir} holds an unfinished run; rerun with --overwrite",
              file=sys.stderr)
        sys.stderr.flush()
        os._exit(130)  # at once, as petal.py's `interrupted`: the engine's threads, cut off, print tracebacks
    return steps.report(job_summary)


class CtrlC:
    """Whether a Ctrl-C has come, answered from any thread as soon as the kernel holds it for this process.

    A terminal signals the job and its Beam workers at once, and a worker can print its traceback before the job's
    main thread runs Python's handler: that waits for the main thread to come back from C. The signal is seen
    earlier: pending in the process's shared set (/proc/self/status, ShdPnd) until a thread takes it, then in the
    byte Python's C-level handler writes to the wakeup fd that `stopped_by_ctrl_c` sets."""

    def __init__(self) -> None:
        self._seen = threading.Event()
        self._lock = threading.Lock()  # the relay's thread and the logging threads ask while the block closes
        self.wakeup_read, self.wakeup_write = os.pipe()
        for end in (self.wakeup_read, self.wakeup_write):
            os.set_blocking(end, False)

    def __enter__(self) -> CtrlC:
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            os.close(self.wakeup_read)
            os.close(self.wakeup_write)
            self.wakeup_read = -1

    def set(self) -> None:
        self._seen.set()

    def is_set(self) -> bool:
        if not self._seen.is_set():
            with self._lock:
                if self._in_wakeup() or _sigint_pending():
                    self._seen.set()
        return self._seen.is_set()

    def _in_wakeup(self) -> bool:
        with contextlib.suppress(BlockingIOError):
            return self.wakeup_read >= 0 and signal.SIGINT in os.read(self.wakeup_read, 512)
        return False


def _sigint_pending() -> bool:
    """Whether a SIGINT is pending for this process, not yet taken by any thread (False where /proc has no such
    line, off Linux)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("ShdPnd:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    return False


@contextlib.contextmanager
def stopped_by_ctrl_c(interrupted: CtrlC) -> Iterator[None]:
    """Within the block a Ctrl-C sets `interrupted`, after which nothing more is logged, and leaves it as a
    KeyboardInterrupt, whatever the engine made of it (Beam's in-memory runner raised a RuntimeError, after an
    ERROR log line with the traceback of every frame it went through). A no-op outside the main thread, which
    alone can take signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        interrupted.set()
        raise KeyboardInterrupt

    def not_after_it(record: logging.LogRecord) -> bool:
        return not interrupted.is_set()

    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(not_after_it)
    previous = signal.signal(signal.SIGINT, stop)
    previous_wakeup = signal.set_wakeup_fd(interrupted.wakeup_write, warn_on_full_buffer=False)
    try:
        yield
    except BaseException:
        if interrupted.is_set():
            raise KeyboardInterrupt from None
        raise
    finally:
        signal.set_wakeup_fd(previous_wakeup)
        signal.signal(signal.SIGINT, previous)
        for handler in handlers:
            handler.removeFilter(not_after_it)


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
    try:
        with import_warnings_hidden(quiet()):
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != package:
            raise
        print(f"petal batch --engine={engine} needs {package}: pip install 'petal[{extra}]'", file=sys.stderr)
        return 2
    return module.main(argv)
