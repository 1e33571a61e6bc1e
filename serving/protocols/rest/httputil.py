"""The HTTP pieces that TF Serving's REST API and KServe V2 share, so both protocols answer alike: JSON error
bodies (503s with Retry-After), inflated request bodies under one size limit, strict JSON, number and base64 parsing.

Numbers in paths, query strings and headers are parsed as ASCII decimal only: `str.isdigit` accepts "²" and other
Unicode digits that `int` then rejects, which would turn a bad request into a 500.
(Named httputil, not http, so that it can never shadow the standard library's http package.)
"""
from __future__ import annotations

import binascii
import json
import math
import re
import zlib

import flask
import numpy as np
import pybase64
from werkzeug.exceptions import RequestEntityTooLarge

from serving.core import invalid
from serving.memory import BODY_BYTES_FACTOR, JSON_VALUE_BYTES
from serving.protocols.admission import charge

RETRY_AFTER_SECONDS = "1"
JSON_MIMETYPE = "application/json"
_ASCII_DECIMAL = re.compile(r"[0-9]+")
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_INFLATE_CHUNK = 16 * 1024  # compressed bytes fed per step, so a member's leftover input is never copied whole
MAX_GZIP_MEMBERS = 10_000  # RFC 1952 allows any number; each costs a decompressor, so a flood of empty ones is a 400

# Strict JSON (see parse_json). Tensors never nest deeper than a few levels; the limit stops the recursion of
# json.loads and of every decoder that walks the parsed value long before Python's recursion limit.
MAX_JSON_DEPTH = 64
MAX_NUMBER_DIGITS = 100  # int64 needs 19 digits and a float 17 significant ones; more is hostile
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# Digits all read "0" and exponents "e" (a "+" dropped), so that two plain substring searches, far faster than a
# regex, find an over-long number and an exponent of three digits or more (with the mantissa capped, only such an
# exponent can overflow a float).
_NUMBER_SHAPE = bytes.maketrans(b"123456789E", b"000000000e")
_LONG_NUMBER = b"0" * (MAX_NUMBER_DIGITS + 1)
_BIG_EXPONENT = b"e000"
_DEPTH_CHUNK = 1 << 20  # brackets summed at a time, so the running depths never take much memory
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


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


def is_json_int(value: object) -> bool:
    """Whether a parsed JSON value is an integer: JSON true and false are not, though Python's bools are ints."""
    return isinstance(value, int) and not isinstance(value, bool)


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
    max_bytes, so a compression bomb gets the same 413 as an oversized body. A gzip body may hold several members
    (RFC 1952 §2.2, as `cat a.gz b.gz` makes); all are inflated, under the one limit."""
    data = flask.request.get_data(cache=True)
    encoding = flask.request.headers.get("Content-Encoding", "").lower()
    if encoding not in _WBITS or not data:
        return data
    inflated = inflate(data, encoding, max_bytes)
    charge(len(inflated) * BODY_BYTES_FACTOR)  # the memory budget's hold (serving/protocols/admission.py)
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


class _Hostile(ValueError):
    """Raised from inside json.loads by the strictness hooks; parse_json makes it a 400."""


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Hostile(f"duplicate key {key[:100]!r} in an object")
            seen.add(key)
    return value


def _no_constant(name: str) -> object:
    raise _Hostile(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Hostile(f"number {text[:40]}{'...' if len(text) > 40 else ''} is out of range of a float")
    return value


def bracket_depth(unquoted: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep the arrays and objects of a JSON document nest (exactly, up to the first depth past `limit`), given
    the document with its strings (whose brackets do not count) cut out: bytes.translate drops every byte but the
    brackets, and numpy's cumulative sum of +1 per opening and -1 per closing bracket gives the depth after each.
    Both run in C, without recursing."""
    brackets = unquoted.translate(None, _NOT_BRACKETS)
    # "[" 0x5B and "{" 0x7B have bit 1 set, "]" 0x5D and "}" 0x7D do not: +1 or -1 per bracket.
    steps = (np.frombuffer(brackets, dtype=np.uint8) & 2).view(np.int8) - 1
    depth = deepest = 0
    for start in range(0, len(steps), _DEPTH_CHUNK):
        running = np.cumsum(steps[start:start + _DEPTH_CHUNK], dtype=np.int64) + depth
        deepest, depth = max(deepest, int(running.max())), int(running[-1])
        if deepest > limit:
            break
    return deepest


def parse_json(data: bytes) -> object:
    """A JSON document, with TF Serving's messages for an empty or malformed one (both a 400).

    Strict, so that no hostile body gets past it to a 500 or a long CPU burn: nesting deeper than MAX_JSON_DEPTH,
    duplicate keys, NaN and Infinity, numbers of more than MAX_NUMBER_DIGITS digits or out of range of a float,
    bodies that are not valid Unicode (raw or escaped lone surrogates included) are all 400s.

    The depth and number checks scan the bytes before json.loads recurses, on a copy with the strings cut out. For
    a document json.loads parses at least as far as it recurses, that copy is exact (strings are found the same
    way, left to right); for a malformed one it may differ, and json.loads rejects it anyway. The float hook is
    only installed when the scan finds a suspect exponent, so an ordinary body is parsed at the full speed of the C
    scanner. The same copy counts the values that will become Python objects (numbers, mostly), whose cost is
    charged to the request's memory hold before json.loads makes them."""
    if not data or data.isspace():
        raise invalid("JSON Parse error: The document is empty")
    try:
        encoding = json.detect_encoding(data)
        text = data.decode(encoding)  # strict: unlike json.loads(bytes), no UTF-8-encoded surrogates
        if encoding != "utf-8":
            data = text.encode("utf-8")  # the scans below need ASCII punctuation as single bytes
        escapes = b"\\" in data
        # Without a backslash every quote opens or closes a string, and bytes.split finds them at memchr speed; the
        # regex, several times slower on long (base64) strings, is left for documents with escapes.
        unquoted = _JSON_STRING.sub(b'""', data) if escapes else b'""'.join(data.split(b'"')[::2])
        # Nesting needs at least as many brackets as levels; a predict body has a few, so counting them spares the
        # exact depth scan.
        if unquoted.count(b"[") + unquoted.count(b"{") > MAX_JSON_DEPTH and bracket_depth(unquoted) > MAX_JSON_DEPTH:
            raise _Hostile(f"arrays and objects nest deeper than the limit of {MAX_JSON_DEPTH} levels")
        charge((unquoted.count(b",") + 1) * JSON_VALUE_BYTES)  # a value per comma, outside strings
        shape = unquoted.translate(_NUMBER_SHAPE, b"+")
        if _LONG_NUMBER in shape:
            raise _Hostile(f"a number has more than {MAX_NUMBER_DIGITS} digits")
        value = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant,
                           parse_float=_finite_float if _BIG_EXPONENT in shape else None)
        if escapes and _SURROGATE_ESCAPE.search(data):
            # An escaped surrogate pair (\ud83d\ude00) is fine: json.loads joins it. A lone one leaves a str that
            # can never be encoded as UTF-8. Rare enough to check the slow way, only when one is present.
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        return value
    except UnicodeEncodeError:
        raise invalid("JSON Parse error: a string holds a lone UTF-16 surrogate escape (\\uD800-\\uDFFF)") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise invalid(f"JSON Parse error: {error}") from None


def b64decode(text: object, what: str) -> bytes:
    """Standard base64 with padding only: URL-safe or unpadded text is an error rather than silently wrong bytes.

    pybase64 (SIMD) rather than the standard library: a photo's base64 is tens of KB on every predict, and the
    standard library's validating decode spent about 80 us on each under the GIL, a tenth of a request's Python."""
    if not isinstance(text, str):
        raise invalid(f"{what} must be a string of standard base64")
    try:
        return pybase64.b64decode(text, validate=True)
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
