"""The HTTP pieces that TF Serving's REST API and KServe V2 share, so both protocols answer alike: JSON bodies and
error bodies (503s with Retry-After), and request bodies inflated under one size limit. (What the bodies say is
the codecs' business: serving/protocols/codec/.)

(Named httputil, not http, so that it can never shadow the standard library's http package.)
"""
from __future__ import annotations

import zlib

import flask
from werkzeug.exceptions import RequestEntityTooLarge, UnsupportedMediaType

from serving.core import invalid
from serving.memory_costs import BODY_BYTES_FACTOR
from serving.protocols.codec import strict_json
from serving.protocols.codec.strict_json import Charge

RETRY_AFTER_SECONDS = "1"
JSON_MIMETYPE = "application/json"
# x-gzip: gzip's other name, which RFC 9110 §8.4.1.3 asks a recipient to read as gzip.
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
AS_SENT = frozenset({"", "identity"})  # no Content-Encoding, or RFC 9110's name for none
_INFLATE_CHUNK = 16 * 1024  # compressed bytes fed per step, so a member's leftover input is never copied whole
MAX_GZIP_MEMBERS = 10_000  # RFC 1952 allows any number; each costs a decompressor, so a flood of empty ones is a 400

def json_response(body: bytes, status: int = 200) -> flask.Response:
    """A JSON answer a codec encoded."""
    return flask.Response(body, status=status, mimetype=JSON_MIMETYPE)


def error_response(status: int, message: str) -> flask.Response:
    """{"error": message}; 429 and 503 say when to retry, so well-behaved clients back off instead of hammering."""
    response = json_response(strict_json.encode({"error": message}), status)
    if status in (429, 503):
        response.headers["Retry-After"] = RETRY_AFTER_SECONDS
    return response


def current_request() -> flask.Request:
    """The request itself, for code that reads it more than once: each read through Flask's `flask.request` proxy
    costs three Python calls."""
    return flask.request._get_current_object()  # type: ignore[attr-defined]  # werkzeug's LocalProxy method


def content_encoding(request: flask.Request) -> str:
    """The request's Content-Encoding as compared: lower case, "" when none is sent."""
    return request.environ.get("HTTP_CONTENT_ENCODING", "").strip().lower()


def request_body(request: flask.Request, max_bytes: int, charge: Charge) -> bytes:
    """The raw body, inflated for Content-Encoding gzip or deflate (as curl and tritonclient send), never past
    max_bytes, so a compression bomb gets the same 413 as an oversized body; the inflated bytes are charged to the
    request's memory budget (`charge`). A gzip body may hold several members (RFC 1952 §2.2, as `cat a.gz b.gz`
    makes); all are inflated, under the one limit. A chunked body declares no length: werkzeug reads it up to
    max_bytes and stops there, with no error, so a longer one came out cut short and was parsed or decoded. Any
    other coding (br, zstd, a list of codings) is a 415 before the body is read (RFC 9110 §15.5.16), where it was
    once parsed as if it were not encoded."""
    encoding = content_encoding(request)
    if encoding not in _WBITS and encoding not in AS_SENT:
        raise UnsupportedMediaType(f"Unsupported Content-Encoding {encoding!r}: send the body as is, or with gzip "
                                   "or deflate")
    data = request.get_data(cache=True)
    if len(data) >= max_bytes and request.content_length is None and request.environ["wsgi.input"].read(1):
        raise RequestEntityTooLarge()
    if encoding in AS_SENT or not data:
        return data
    inflated = inflate(data, encoding, max_bytes)
    charge(len(inflated) * BODY_BYTES_FACTOR)
    return inflated


def inflate(data: bytes, encoding: str, max_bytes: int) -> bytes:
    """`data` inflated: every member of a gzip body, one zlib stream for deflate; 413 past max_bytes, 400 for a
    corrupt, truncated or trailing-garbage body. Input goes in bounded chunks so that the leftover input a finished
    member hands back (zlib's unused_data, a copy) stays small however many members follow."""
    view, out, position, members = memoryview(data), bytearray(), 0, 1
    inflater = zlib.decompressobj(_WBITS[encoding])
    while True:
        chunk = view[position:position + _INFLATE_CHUNK]
        position += len(chunk)
        try:
            out += inflater.decompress(chunk, max_bytes + 1 - len(out))
        except zlib.error as error:
            raise invalid(f"Invalid {encoding} body: {error}") from None
        if len(out) > max_bytes or inflater.unconsumed_tail:
            raise RequestEntityTooLarge(f"The decompressed body exceeds --max_request_bytes ({max_bytes})")
        if not inflater.eof:
            if position >= len(view):
                raise invalid(f"Invalid {encoding} body: the compressed stream is truncated")
            continue
        leftover = len(inflater.unused_data)
        if not leftover and position >= len(view):
            return bytes(out)
        if encoding != "gzip":
            raise invalid(f"Invalid {encoding} body: data after the end of the compressed stream")
        members += 1
        if members > MAX_GZIP_MEMBERS:
            raise invalid(f"Invalid gzip body: more than {MAX_GZIP_MEMBERS} members")
        position -= leftover
        inflater = zlib.decompressobj(_WBITS[encoding])
