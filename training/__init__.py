"""Training: data -> TFRecords -> input pipeline -> model -> train/eval -> export. It never imports serving."""
from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator

# The logger long jobs report progress on. `petal` keeps it at INFO even when every other log is quiet.
PROGRESS_LOGGER = "petal.progress"


class JsonFormatter(logging.Formatter):
    """One JSON object per line, so logs can be shipped and queried without parsing prose. Here, beside the progress
    logger, so that a batch job's worker processes write progress as `petal` itself logs (serving/batch_prediction/
    model_handler.py)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
                 "msg": record.getMessage()}
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


@contextlib.contextmanager
def import_warnings_hidden(hidden: bool = True) -> Iterator[None]:
    """Python's logging shows only errors within the block, if `hidden`: libraries that warn as they are imported
    (Beam, of the Google Cloud clients it lacks: "apitools not found") say nothing a user of Petal's commands, batch
    jobs or benchmarks can act on. Here, beside the one log line shape, for each of them to import under."""
    root = logging.getLogger()
    level = root.level
    if hidden:
        root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)
