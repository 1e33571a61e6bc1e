"""How the gevent worker writes responses: the header block goes out with the body in one send, and every kind of
response still arrives whole on a keep-alive connection (bodiless ones, files sent with sendfile, JSON)."""
from __future__ import annotations

import http.client
import json
import os
import socket

from server_harness import ROOT, b64, jpeg
from serving.gevent_worker import COALESCE_LIMIT, DeadlineSocket

HEAD = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n"
STATIC = os.path.join(ROOT, "serving", "protocols", "static")


class RecordingSocket:
    """The one stand-in here: it records each sendall, which a real socket cannot show."""

    def __init__(self):
        self.writes: list[bytes] = []

    def sendall(self, data, *flags):
        self.writes.append(bytes(data))


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


def test_every_kind_of_response_arrives_whole_on_one_keep_alive_connection(tiny_server):
    host, port = tiny_server.rest_url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    with open(os.path.join(STATIC, "petal.css"), "rb") as f:
        css = f.read()
    body = json.dumps({"instances": [b64(jpeg())]})
    for _ in range(2):
        connection.request("HEAD", "/healthz")
        response = connection.getresponse()
        assert response.status == 200 and response.read() == b""
        assert int(response.headers["Content-Length"]) > 0

        connection.request("GET", "/ui/petal.css")  # a file: gunicorn's sendfile path
        response = connection.getresponse()
        assert response.status == 200 and response.read() == css

        connection.request("POST", "/v1/models/flowers:predict", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and len(json.loads(response.read())["predictions"]) == 1

        connection.request("POST", "/v1/models/flowers:predict", "{", {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 400 and "error" in json.loads(response.read())
    assert connection.sock is not None, "the server closed the keep-alive connection"
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
