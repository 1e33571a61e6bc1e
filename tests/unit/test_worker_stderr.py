"""What the master writes for each line a worker printed on its stderr (serving/process/worker_stderr.py): a JSON
object's line as it is, anything else as a JSON record; tests/e2e/test_server_log.py runs it in a real server."""
from __future__ import annotations

import functools
import json
import os

from serving import tensorflow_logs
from serving.process.worker_stderr import LOGGER, as_json
from serving.tensorflow_logs import relay_lines


def record(line: bytes, pid: int | None = 42) -> dict:
    written = as_json(line, pid)
    assert written.endswith(b"\n") and written.count(b"\n") == 1, written
    return json.loads(written)


def test_a_json_line_passes_as_it_is():
    line = b'{"ts": 1.0, "level": "WARNING", "logger": "serving.core", "msg": "x"}'
    assert as_json(line + b"\r", 42) == line + b"\n"


def test_libjpegs_line_becomes_a_warning_with_the_workers_pid():
    entry = record(b"Input file read error")
    assert {k: entry[k] for k in ("level", "logger", "msg", "pid")} == {
        "level": "WARNING", "logger": LOGGER, "msg": "Input file read error", "pid": 42}
    assert isinstance(entry["ts"], float)


def test_an_absl_line_keeps_its_severity():
    line = b"E0000 00:00:1796224615.730948   31342 cuda_platform.cc:52] failed call to cuInit: UNKNOWN ERROR (303)"
    assert record(line)["level"] == "ERROR"
    assert record(b"I1202 15:00:00.000001    7 cpu_feature_guard.cc:210] This TensorFlow binary is optimized")[
        "level"] == "INFO"


def test_the_first_line_of_a_crash_is_critical_and_its_stacks_are_warnings():
    assert record(b"Fatal Python error: Segmentation fault")["level"] == "CRITICAL"
    assert record(b'  File "/opt/petal/lib/python3.11/site-packages/gevent/hub.py", line 647 in run')[
        "level"] == "WARNING"


def test_what_only_looks_like_json_is_wrapped_and_bytes_that_are_not_utf8_survive():
    assert record(b"{not json")["msg"] == "{not json"
    assert record(b'["a list"]')["msg"] == '["a list"]'
    assert record(b"caf\xe9 \x00")["msg"] == "caf\ufffd \x00"


def test_a_blank_line_is_nothing():
    assert as_json(b"  \r", 42) == b""


def test_the_relay_writes_each_line_transformed_and_cuts_a_line_that_never_ends(monkeypatch):
    """tensorflow_logs.relay_lines, which the master runs for each worker's pipe: what a worker wrote, through
    `as_json`, in order, blank lines dropped, and a last line that never ends written out in pieces of
    MAX_LINE_BYTES, so the master does not hold it all."""
    monkeypatch.setattr(tensorflow_logs, "MAX_LINE_BYTES", 8)
    source, sink = os.pipe(), os.pipe()
    os.write(source[1], b'{"msg": "json"}\nInput file read error\n\n0123456789abcdef01')
    os.close(source[1])
    relay_lines(source[0], sink[1], functools.partial(as_json, pid=7))
    os.close(sink[1])
    with os.fdopen(sink[0], "rb") as out:
        written = out.read().splitlines()
    assert written[0] == b'{"msg": "json"}'
    assert [json.loads(line)["msg"] for line in written[1:]] == [
        "Input file read error", "01234567", "89abcdef", "01"]
