"""The HTTP pieces that TF Serving's REST API and KServe V2 share, so both protocols answer alike: JSON error
bodies (503s with Retry-After), inflated request bodies under one size limit, strict number and base64 parsing.

Numbers in paths, query strings and headers are parsed as ASCII decimal only: `str.isdigit` accepts "²" and other
Unicode digits that `int` then rejects, which would turn a bad request into a 500.
(Named httputil, not http, so that it can never shadow the standard library's http package.)
"""
from __future__ import annotations

import base64
import binascii
import json
import re
import zlib

import flask
from werkzeug.exceptions import RequestEntityTooLarge

from serving.core import invalid

RETRY_AFTER_SECONDS = "1"
JSON_MIMETYPE = "application/json"
_ASCII_DECIMAL = re.compile(r"[0-9]+")
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def dumps(body: object) -> str:
    return json.dumps(body, separators=(",", ":"))


def json_response(body: object, status: int = 200) -> flask.Response:
    return flask.Response(dumps(body), status=status, mimetype=JSON_MIMETYPE)


def error_response(status: int, message: str) -> flask.Response:
    """{"error": message}; 429 and 503 say when to retry, so well-behaved clients back off instead of hammering."""
    response = json_response({"error": message}, status)
    if status in (429, 503):
        response.headers["Retry-After"] = RETRY_AFTER_SECONDS
    return response


def ascii_int(text: str | None) -> int | None:
    """The non-negative integer `text` spells in ASCII decimal digits, else None."""
    if text is None or not _ASCII_DECIMAL.fullmatch(text):
        return None
    return int(text)


def parse_version(text: str | None) -> int | None:
    """A /versions/N path segment; None when the path names no version."""
    if text is None:
        return None
    version = ascii_int(text)
    if version is None:
        raise invalid(f"Malformed request: version {text!r} is not an integer")
    return version


def request_body(max_bytes: int) -> bytes:
    """The raw body, inflated for Content-Encoding gzip or deflate (as curl and tritonclient send), never past
    max_bytes, so a compression bomb gets the same 413 as an oversized body."""
    data = flask.request.get_data(cache=True)
    encoding = flask.request.headers.get("Content-Encoding", "").lower()
    if encoding not in _WBITS:
        return data
    inflater = zlib.decompressobj(_WBITS[encoding])
    try:
        data = inflater.decompress(data, max_bytes + 1)
    except zlib.error as error:
        raise invalid(f"Invalid {encoding} body: {error}") from None
    if len(data) > max_bytes or inflater.unconsumed_tail:
        raise RequestEntityTooLarge(f"The decompressed body exceeds --max_request_bytes ({max_bytes})")
    return data


def parse_json(data: bytes) -> object:
    """A JSON document, with TF Serving's messages for an empty or malformed one (both a 400)."""
    if not data.strip():
        raise invalid("JSON Parse error: The document is empty")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        raise invalid(f"JSON Parse error: {error}") from None


def b64decode(text: object, what: str) -> bytes:
    """Standard base64 with padding only: URL-safe or unpadded text is an error rather than silently wrong bytes."""
    if not isinstance(text, str):
        raise invalid(f"{what} must be a string of standard base64")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"Unable to base64 decode {what}: the value is not standard (RFC 4648 §4) base64 with "
                      "padding; URL-safe base64 is not accepted") from None


def string_field(body: dict, key: str, default: str = "") -> str:
    """A field that must hold a string (such as signature_name), so a list or object is a 400, not a TypeError."""
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise invalid(f"\"{key}\" must be a string, got {type(value).__name__}")
    return value


def object_field(body: dict, key: str, where: str) -> dict:
    """A field that must hold a JSON object when present (such as V2 `parameters`)."""
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"{where}'{key}' must be an object, got {type(value).__name__}")
    return value
