"""Which thread serves the worker's only request in flight (serving/threads.py): such a thread runs a Session's
graph itself (serving/core/runtimes.py), so a wrong answer either costs a lone request its thread switches or puts
the model's work at full priority beside other requests' readers."""
import threading

import pytest

from serving import threads


def test_a_call_is_alone_only_while_no_other_call_is_in_flight(monkeypatch):
    monkeypatch.setattr(threads, "_loop", {})  # no gevent loop: the threads of a gRPC server
    calls, seen = threads.CallCount(), []

    def another():
        with calls:
            seen.append(("another, during the first", threads.alone()))

    with calls:
        seen.append(("first", threads.alone()))
        thread = threading.Thread(target=another)
        thread.start()
        thread.join(5)
        seen.append(("first, after the other ended", threads.alone()))
    seen.append(("between calls", threads.alone()))
    with calls:
        seen.append(("next", threads.alone()))
    assert seen == [("first", True), ("another, during the first", False), ("first, after the other ended", True),
                    ("between calls", False), ("next", True)]


def test_a_call_that_fails_leaves_no_call_in_flight(monkeypatch):
    monkeypatch.setattr(threads, "_loop", {})
    calls = threads.CallCount()
    with pytest.raises(ValueError), calls:
        raise ValueError("the servicer's error")
    with calls:
        assert threads.alone()
