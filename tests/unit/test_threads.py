"""Which thread serves the worker's only request in flight (serving/threads.py): such a thread runs a Session's
graph itself (serving/core/runtimes.py), so a wrong answer either costs a lone request its thread switches or puts
the model's work at full priority beside other requests' readers. And how long a wait for a deadline waits."""
import threading
import time

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


# --- far deadlines: a wait past threading.TIMEOUT_MAX raised OverflowError, which became INTERNAL or a 500 -------

def test_a_far_deadline_is_no_deadline_and_a_near_one_is_kept():
    now = time.monotonic()
    assert threads.timeout_until(None) is None
    assert threads.timeout_until(now + 2 * threading.TIMEOUT_MAX) is None
    assert 0 < threads.timeout_until(now + 5) <= 5
    assert threads.timeout_until(now - 1) == 0.0
