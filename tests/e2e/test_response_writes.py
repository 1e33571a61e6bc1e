"""How the gevent worker writes responses: every kind of response arrives whole on a keep-alive connection to a real
server (bodiless ones, files sent with sendfile, JSON). That the header block goes out with the body in one send
is tests/unit/test_coalesced_writes.py."""
from __future__ import annotations

import http.client
import json
import os
import socket

from server_harness import ROOT, b64, jpeg

STATIC = os.path.join(ROOT, "serving", "protocols", "rest", "static")


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
