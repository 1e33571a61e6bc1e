"""What the driver checks before it asks any worker for work, the same for both engines (docs/batch.md, 'When a job
cannot start').

A job that cannot succeed must say so in seconds, in one line, before a cluster spends minutes failing every task
with a traceback wrapped in Java: so the driver makes every local path absolute (an executor's working directory
is not the driver's), loads the model and checks its signature, and proves the output folder writable, on a disk
or an object store alike (exported_models/storage.py, whose errors are one line already). The engines add what
only they know: whether their workers run on this machine (serving/batch_prediction/job.py, spark_job.py).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Iterator

import tensorflow as tf
from google.protobuf.message import DecodeError

from exported_models import storage
from serving.batch_prediction import steps
from serving.core.errors import ServingError, op_error_message

logger = logging.getLogger(__name__)

PATH_FLAGS = ("model_dir", "input", "output_dir")
WRITE_CHECK = ".petal-write-check"


class CannotStart(Exception):
    """The job cannot start; the message is the one line the user sees (exit status 2)."""


def absolute(path: str) -> str:
    """A local path as every process on this machine reads it, whatever its working directory; a URL as it is."""
    return path if steps.shared_path(path) else os.path.abspath(os.path.expanduser(path))


def resolve_paths(args: argparse.Namespace, names: tuple[str, ...] = PATH_FLAGS) -> None:
    """Makes the named path flags absolute, once, on the driver (flags left out stay None)."""
    for name in names:
        value = getattr(args, name)
        if value is not None:
            setattr(args, name, absolute(value))


def first_line(error: Exception) -> str:
    """What went wrong, in one line: a TensorFlow error's own message without its op noise, else the first line."""
    if isinstance(error, tf.errors.OpError):
        return op_error_message(error.message)
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


@contextlib.contextmanager
def on_store(flag: str, path: str) -> Iterator[None]:
    """A store that cannot be listed or read, or whose package is not installed, as the line that names the flag."""
    try:
        yield
    except storage.StorageError as error:
        raise CannotStart(f"{flag} {path}: {error}") from None


def load_model(args: argparse.Namespace) -> steps.ModelInfo:
    """The model read, loaded and its signature checked here, so that a model no worker could load stops the job
    before any starts. The loaded copy is dropped again: the workers load their own.

    A missing model or a signature the flags do not fit already says so in one line (FileNotFoundError,
    ValueError); what TensorFlow or protobuf raise about an unreadable one is cut to its first line."""
    try:
        with on_store("--model_dir", args.model_dir):
            info = steps.read_model_info(args.model_dir, args.signature_name, args.method, args.input_format)
    except (DecodeError, tf.errors.OpError) as error:
        raise CannotStart(f"--model_dir {args.model_dir}: cannot read the SavedModel: {first_line(error)}") from None
    try:
        steps.check_model(info)
    except (OSError, ValueError, KeyError, tf.errors.OpError, ServingError) as error:
        logger.info("model check failed", exc_info=True)
        raise CannotStart(f"--model_dir {args.model_dir}: cannot load {info.path}: {first_line(error)}") from None
    return info


def check_inputs(pattern: str, input_format: str) -> list[str]:
    """The files the pattern matches; none fails the job before any worker starts (a typo would otherwise
    'succeed')."""
    with on_store("--input", pattern):
        files = steps.list_files(pattern)
    if not files:
        raise FileNotFoundError(f"--input {pattern} matches no files (format {input_format})")
    return files


def check_output_dir(output_dir: str, overwrite: bool) -> None:
    """Refuses a used folder (steps.prepare_output_dir), then writes and deletes one empty file in it, so that a
    folder no task could write fails now rather than in every task."""
    with on_store("--output_dir", output_dir):
        steps.prepare_output_dir(output_dir, overwrite)
    probe = storage.join(output_dir, WRITE_CHECK)
    try:
        storage.makedirs(output_dir)
        with storage.open_file(probe, "wb"):
            pass
        steps.remove([probe])
    except OSError as error:
        raise CannotStart(f"--output_dir {output_dir} cannot be written: {storage.describe(error)}") from None
