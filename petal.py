"""The `petal` command.

A dispatcher only: each subcommand lives in the package it belongs to and parses its own flags, so that
`petal serve` never pays for importing Beam and training never imports serving.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import NoReturn

from training import PROGRESS_LOGGER, JsonFormatter, import_warnings_hidden

COMMANDS: dict[str, tuple[str, str, str]] = {  # name: (module, extra that installs its dependencies, help)
    "synth": ("training.synth", "train", "generate the synthetic flowers dataset (JPEGs + train/eval CSVs)"),
    "tfrecords": ("training.tfrecords", "train", "convert JPEGs to sharded TFRecords with Apache Beam"),
    "train": ("training.train", "train", "train and evaluate, checkpointing and resuming"),
    "export": ("training.export", "train", "export a checkpoint as a SavedModel that takes JPEG bytes"),
    "serve": ("serving.process.server", "", "serve models over REST and gRPC (tensorflow_model_server flags)"),
    "predict": ("serving.client.cli", "", "classify images in-process or against a server"),
    "batch": ("serving.batch_prediction.cli", "batch", "run a batch prediction job on Apache Beam or Spark"),
    "loadtest": ("load_tests.runner", "loadtest", "run Locust load tests against latency SLOs"),
}
# Commands that only load SavedModels, which need no Keras. TensorFlow imports Keras eagerly when it is installed (to
# register its optimizers for SavedModels that hold them), and Keras imports matplotlib when that is installed;
# a module set to None in sys.modules makes that import fail, which TensorFlow expects of an absent Keras. Measured
# with the test extras installed: TensorFlow's import 2.7 -> 1.9 s and a serving worker 49 MB smaller.
WITHOUT_KERAS = {"serve", "predict", "batch"}
# Commands whose module imports TensorFlow here (`petal serve` imports it in its workers only): it is imported first,
# without its C++ start-up lines (serving/tensorflow_logs.py).
IMPORT_TENSORFLOW = {"batch", "tfrecords", "train", "export"}
# Third-party packages that only an extra installs; a command that needs a missing one says which extra to add.
EXTRA_PACKAGES = {"apache_beam", "locust", "matplotlib", "tensorboard", "google_crc32c"}
# What a Ctrl-C leaves, said after `petal COMMAND: interrupted` (`petal batch` says it of its output folder itself).
INTERRUPTED_HINTS = {"train": "; the same command resumes from its last checkpoint"}


def configure_logging(verbose: bool) -> None:
    """Quiet by default: warnings only, and TensorFlow's C++ chatter off unless asked for (TF_CPP_MIN_LOG_LEVEL,
    which serving/tensorflow_logs.py also applies to the lines TensorFlow prints as it is imported).

    Long jobs report progress on the `petal.progress` logger, which stays at INFO either way: a conversion or
    batch job that runs for an hour must show it is alive without turning on every library's INFO logs.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if verbose else "3")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler], force=True)
    logging.getLogger(PROGRESS_LOGGER).setLevel(logging.INFO)


def usage() -> str:
    lines = ["usage: petal [-v] COMMAND [flags]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run `petal COMMAND --help` for a command's flags. -v turns on INFO logs."]
    return "\n".join(lines)


def interrupted(command: str) -> NoReturn:
    """Ctrl-C: one line, and exit status 130 as a shell reports SIGINT, at once: the threads of TensorFlow, Beam or
    Spark, cut off, printed tracebacks as the interpreter shut down, a screenful that said less than this line."""
    print(f"petal {command}: interrupted{INTERRUPTED_HINTS.get(command, '')}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = bool(argv) and argv[0] in ("-v", "--verbose")
    if verbose:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(usage(), file=sys.stdout if argv[:1] in ([], ["-h"], ["--help"]) else sys.stderr)
        return 0 if argv[:1] in ([], ["-h"], ["--help"]) else 2
    try:
        return run(argv, verbose)
    except KeyboardInterrupt:
        interrupted(argv[0])


def run(argv: list[str], verbose: bool) -> int:
    configure_logging(verbose)
    module_name, extra, _ = COMMANDS[argv[0]]
    if argv[0] in WITHOUT_KERAS:
        sys.modules.setdefault("keras", None)  # type: ignore[arg-type]  # None blocks the import
    try:
        with import_warnings_hidden(not verbose):
            if argv[0] in IMPORT_TENSORFLOW:
                from serving.tensorflow_logs import import_tensorflow

                import_tensorflow()
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] not in EXTRA_PACKAGES:
            raise
        print(f"petal {argv[0]} needs {error.name}, which a plain install leaves out: "
              f"pip install 'petal[{extra or 'test'}]'", file=sys.stderr)
        return 2
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
