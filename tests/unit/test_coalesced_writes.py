"""How the gevent worker writes responses, on a recording socket: the header block goes out with the body in one
send, a large body is not copied behind it, and a failed response drops it (that every kind of response still
arrives whole on a real server's keep-alive connection is tests/e2e/test_response_writes.py)."""
from __future__ import annotations

from serving.process.gevent_worker import COALESCE_LIMIT, DeadlineSocket

HEAD = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n"


class RecordingSocket:
    """The one stand-in here: it records each sendall and the timeout it was made under, which a real socket cannot
    show."""

    def __init__(self):
        self.writes: list[bytes] = []
        self.timeout: float | None = None
        self.timeouts: list[float | None] = []

    def settimeout(self, value: float | None) -> None:
        self.timeout = value

    def sendall(self, data, *flags):
        self.writes.append(bytes(data))
        self.timeouts.append(self.timeout)


def deadline_socket() -> tuple[DeadlineSocket, RecordingSocket]:
    raw = RecordingSocket()
    return DeadlineSocket(raw, 10.0, 10.0), raw


def test_the_header_block_and_the_body_go_out_in_one_send():
    sock, raw = deadline_socket()
    sock.start_body()
    sock.sendall(HEAD)
    assert raw.writes == []
    sock.sendall(b"{}")
    sock.flush()
    assert raw.writes == [HEAD + b"{}"]


def test_a_bodiless_response_is_sent_when_the_request_ends():
    sock, raw = deadline_socket()
    sock.start_body()
    sock.sendall(HEAD)
    sock.flush()
    assert raw.writes == [HEAD]


def test_a_large_body_is_not_copied_behind_the_headers():
    sock, raw = deadline_socket()
    sock.start_body()
    sock.sendall(HEAD)
    body = b"x" * (COALESCE_LIMIT + 1)
    sock.sendall(body)
    sock.sendall(b"more")
    assert raw.writes == [HEAD, body, b"more"]


def test_a_failed_response_drops_its_held_headers():
    sock, raw = deadline_socket()
    sock.start_body()
    sock.sendall(HEAD)
    sock.discard()
    sock.sendall(b"HTTP/1.1 500 Internal Server Error\r\n\r\n")
    assert raw.writes == [b"HTTP/1.1 500 Internal Server Error\r\n\r\n"]


def test_writes_outside_a_request_are_not_held():
    sock, raw = deadline_socket()
    sock.sendall(b"HTTP/1.1 503 Service Unavailable\r\n\r\n")
    assert raw.writes == [b"HTTP/1.1 503 Service Unavailable\r\n\r\n"]


def test_each_write_must_be_taken_within_the_body_timeout_plus_a_second_per_64_kib():
    """A client that asks and never reads has its connection broken there (tests/e2e/test_slow_clients.py)."""
    sock, raw = deadline_socket()
    sock.sendall(b"x" * 10)
    sock.sendall(b"x" * 655_360)
    assert [round(t, 1) for t in raw.timeouts] == [10.0, 20.0] and raw.timeout is None
