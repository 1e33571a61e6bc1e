"""What the server, the Python client, the load generators and the tests share, each in one place: the status table
(serving/status_codes.py), which docs/protocols.md states and every client reads; the client's setup for a secured
server (serving/client/security.py); and the fact that importing them, the V2 framing or `petal loadtest` pulls in
neither TensorFlow, grpc nor Flask."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from serving.client import RequestError, Retry, ServerError, failure
from serving.client.security import Security
from serving.status_codes import Code

ROOT = Path(__file__).resolve().parents[2]


def documented_statuses() -> dict[str, int]:
    """docs/protocols.md's table under "Errors": each TF code and the HTTP status REST answers with it."""
    text = (ROOT / "docs" / "protocols.md").read_text()
    table = text[text.index("| code | HTTP |"):].split("\n\n")[0]
    return {code: int(status) for codes, status in re.findall(r"^\| ([A-Z_, ]+?)(?: \(.*?\))? \| (\d{3}) \|$",
                                                             table, re.M)
            for code in codes.split(", ")}


def test_every_code_has_the_http_status_the_docs_give():
    assert documented_statuses() == {code.name: code.http_status for code in Code if code is not Code.OK}


@pytest.mark.parametrize("code", [code for code in Code if code is not Code.OK], ids=str)
def test_the_client_judges_a_grpc_code_as_it_judges_its_http_status(code):
    """A 4xx is the caller's mistake over either transport, UNAVAILABLE (503) is retried, the rest is the server's."""
    over_grpc = failure(code.http_status, code.name, "m")
    over_rest = failure(code.http_status, f"HTTP {code.http_status}", "m")
    assert type(over_grpc) is type(over_rest)
    expected = RequestError if 400 <= code.http_status < 500 else Retry if code is Code.UNAVAILABLE else ServerError
    assert isinstance(over_grpc, expected)


def test_security_headers_metadata_and_tls_files(tmp_path):
    assert Security().header() == {} and Security().grpc_metadata() is None and not Security("").uses_tls
    secured = Security("t0k", ca_file="ca.pem", cert_file="c.pem", key_file="k.pem")
    assert secured.header() == {"Authorization": "Bearer t0k"}
    assert secured.grpc_metadata() == (("authorization", "Bearer t0k"),)
    assert secured.uses_tls and Security(tls=True).uses_tls
    assert secured.requests_arguments() == {"verify": "ca.pem", "cert": ("c.pem", "k.pem")}
    assert Security(tls=True).requests_arguments() == {"verify": True, "cert": None}
    assert "t0k" not in repr(secured)


def test_the_client_helpers_and_the_load_tester_import_neither_tensorflow_grpc_nor_flask():
    modules = ["serving.client", "serving.client.security", "serving.status_codes", "serving.protocols.codec.v2_bytes",
               "load_tests.runner", "load_tests.perf_analyzer", "load_tests.pixel_flood"]
    probe = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
             "print(sorted(m for m in ('tensorflow', 'grpc', 'flask', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
