"""JSON as a server facing the internet reads it: decoded by msgspec straight into a codec's typed request objects,
and written back by msgspec.

msgspec validates while it parses: a wrong type, a missing field, an unknown enum value or a number out of range
is one ValidationError naming the field's path (`$.inputs[0].datatype`), which becomes INVALID_ARGUMENT with that
path in its message. What JSON allows but a hostile body uses is refused too (docs/security.md, 'Limits'), from
one scan of the document with its strings cut out (`scan`), before msgspec runs:

- nesting deeper than MAX_JSON_DEPTH: the codecs walk tensor values, one Python call per level;
- numbers of more than MAX_NUMBER_DIGITS digits: int64 needs 19 and a float 17 significant ones.

The same scan counts the values that will become Python objects (numbers, mostly, which cost far more than their
bytes), so that the caller charges them to the request's memory budget (`Charge`) before msgspec makes them, and
counts the document's keys: msgspec keeps the last of two equal keys silently, so each codec counts the keys its
typed objects hold and `check_keys` parses the document again, with the standard library, only when the two differ
(a duplicate, or a field the schema ignores). NaN, Infinity, invalid UTF-8 and lone surrogate escapes msgspec
refuses itself; the message says which.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import msgspec
import numpy as np

from serving.core import invalid
from serving.memory_costs import JSON_VALUE_BYTES

T = TypeVar("T")
# Grows the memory budget's hold of the request being decoded by that many bytes, or raises (docs/security.md).
Charge = Callable[[int], None]

MAX_JSON_DEPTH = 64
DEBUG_BYTES = 256  # TF Serving cuts a JSON value quoted in an error to this much
MAX_NUMBER_DIGITS = 100
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")  # so that one substring search finds a long number
_LONG_NUMBER = b"0" * (MAX_NUMBER_DIGITS + 1)
_DEPTH_CHUNK = 1 << 20  # brackets summed at a time, so the running depths never take much memory
# Strings are cut one by one (bytes.find is memchr, bytes.split a byte loop) from a document of SHORT_DOCUMENT bytes
# or more, up to _FEW_STRINGS of them; a shorter document, or one with more strings, is split at once.
_SHORT_DOCUMENT = 4096
_FEW_STRINGS = 32
_BYTE_OFFSET = re.compile(r"\(byte (\d+)\)$")
# A high surrogate escape not followed by a low one, or a low one not preceded by a high one.
_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])|"
                             rb"(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_ENCODER = msgspec.json.Encoder()


def no_charge(nbytes: int) -> None:
    """The charge of a caller that holds no memory budget: the batch job, which sizes its own records."""


class Document(NamedTuple):
    """A scanned JSON document: its UTF-8 bytes, and the keys and objects it holds, counted outside strings."""
    data: bytes
    keys: int
    objects: int


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


def scan(data: bytes, charge: Charge) -> Document:
    """Check what msgspec does not (an empty document, nesting, long numbers), charge the values, count the keys.

    The document is transcoded to UTF-8 first when it is UTF-16 or UTF-32 or starts with a byte-order mark, as
    RFC 8259 lets a reader accept. Its strings are cut out (`_without_strings`): without a backslash every quote
    opens or closes a string; with some, escaped backslashes and then escaped quotes are blanked first (a backslash
    outside a string is malformed JSON, which msgspec then refuses). For a document msgspec parses,
    the cut is exact; for any other the checks may see garbage, and the document is refused either way."""
    if not data:  # json_tensor.cc ParseJson's own words, before RapidJSON's
        raise invalid("JSON Parse error: The document is empty")
    if data.isspace():  # RapidJSON's, at the end of the white space
        raise invalid(f"JSON Parse error: The document is empty. at offset: {len(data)}")
    encoding = json.detect_encoding(data)
    if encoding != "utf-8":
        try:
            data = data.decode(encoding).encode("utf-8")
        except UnicodeError as error:
            raise invalid(f"JSON Parse error: {error}") from None
    plain = data.replace(b"\\\\", b"  ").replace(b'\\"', b"  ") if b"\\" in data else data
    unquoted = _without_strings(plain)
    # Nesting needs at least as many brackets as levels; a predict body has a few, so counting them usually spares
    # the exact depth scan.
    if unquoted.count(b"[") + unquoted.count(b"{") > MAX_JSON_DEPTH and bracket_depth(unquoted) > MAX_JSON_DEPTH:
        raise invalid(f"JSON Parse error: arrays and objects nest deeper than the limit of {MAX_JSON_DEPTH} levels")
    charge((unquoted.count(b",") + 1) * JSON_VALUE_BYTES)  # a value per comma, outside strings
    if _LONG_NUMBER in unquoted.translate(_DIGITS_AS_ZERO):
        raise invalid(f"JSON Parse error: a number has more than {MAX_NUMBER_DIGITS} digits")
    return Document(data, keys=unquoted.count(b":"), objects=unquoted.count(b"{"))


def _without_strings(plain: bytes) -> bytes:
    """The document with each string's contents cut out (`""` left), given no escaped quote in it. A predict body
    has a few strings, one of them tens of KB of base64, so they are found one by one; a short document, or one
    with more than _FEW_STRINGS strings, is split at once."""
    parts, start = [], 0
    for _ in range(_FEW_STRINGS if len(plain) >= _SHORT_DOCUMENT else 0):
        opening = plain.find(b'"', start)
        if opening < 0:
            parts.append(plain[start:])
            return b'""'.join(parts)
        parts.append(plain[start:opening])
        start = plain.find(b'"', opening + 1) + 1
        if not start:  # an unterminated string: msgspec refuses the document
            return b'""'.join(parts)
    return b'""'.join(plain.split(b'"')[::2])


def decode(data: bytes, decoder: msgspec.json.Decoder[T], charge: Charge) -> tuple[T, Document]:
    """`data` as the decoder's type, and the scanned document (for `check_keys`)."""
    document = scan(data, charge)
    try:
        return decoder.decode(document.data), document
    except msgspec.ValidationError as error:
        raise invalid(value_error(str(error), document.data)) from None
    except msgspec.DecodeError as error:
        raise invalid(f"JSON Parse error: {_parse_error(document.data, str(error))}") from None


def debug_text(data: bytes) -> str:
    """The start of a document, as TF Serving quotes the JSON value an error is about (its JsonValueToDebugString
    cuts it to DEBUG_BYTES)."""
    return data[:DEBUG_BYTES].decode("utf-8", "replace")


def value_error(message: str, data: bytes) -> str:
    """A msgspec ValidationError as a client reads it: the field's path is in it, except for the document itself,
    which gets TF Serving's text (json_tensor.cc: `JSON Value: <document> Is not object`)."""
    if message.startswith("Expected `object`") and " - at " not in message:
        return f"JSON Value: {debug_text(data)} Is not object"
    return f"JSON Value error: {message}"


# msgspec's syntax errors in RapidJSON's words (its GetParseError_En), which TF Serving's parse errors carry and its
# clients match on ("JSON Parse error: Invalid value", http_rest_api_handler_test.cc); the first that is found in
# msgspec's message applies.
_RAPIDJSON_TEXTS = (
    ("trailing characters", "The document root must not be followed by other values."),
    ("expected ',' or ']'", "Missing a comma or ']' after an array element."),
    ("expected ',' or '}'", "Missing a comma or '}' after an object member."),
    ("expected ':'", "Missing a colon after a name of object member."),
    ("object keys must be strings", "Missing a name for object member."),
    ("trailing comma in object", "Missing a name for object member."),
    ("invalid escape character", "Invalid escape character in string."),
    ("unicode escape", "Incorrect hex digit after \\u escape in string."),
    ("Invalid UTF-8", "Invalid encoding in string."),
)


def _parse_error(data: bytes, message: str) -> str:
    """msgspec's syntax error as RapidJSON words it, with the offset TF Serving adds; said plainly for the mistakes
    clients make that TF Serving accepts and Petal does not: Python's json.dumps writes NaN and Infinity for
    non-finite floats, and a lone UTF-16 surrogate can never become text."""
    if "surrogate" in message or _LONE_SURROGATE.search(data):
        return "a string holds a lone UTF-16 surrogate escape (\\uD800-\\uDFFF)"
    match = _BYTE_OFFSET.search(message)
    at = int(match[1]) if match else len(data)
    if match:
        start = at - (data[at - 1:at] == b"-")
        for word in (b"NaN", b"Infinity", b"-Infinity"):
            if data.startswith(word, start):
                return f"{word.decode()} is not a JSON number"
    text = next((text for key, text in _RAPIDJSON_TEXTS if key in message), "Invalid value.")
    return f"{text} at offset: {at}"


class _Duplicate(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> None:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _Duplicate(key)
        seen.add(key)


def check_keys(document: Document, counted: int) -> None:
    """Refuse a document in which an object has a key twice, given the keys its typed objects hold: the parse kept
    one of each, so fewer than the document has means a duplicate, or a field the schema ignores (which TF
    Serving's and KServe's clients may send). Only then is the document parsed again, to tell which."""
    if counted == document.keys:
        return
    try:
        json.loads(document.data, object_pairs_hook=_refuse_duplicates)
    except _Duplicate as duplicate:
        raise invalid(f"JSON Parse error: duplicate key {duplicate.key[:100]!r} in an object") from None


def present(struct: msgspec.Struct) -> int:
    """The keys a decoded object had: its fields that are not UNSET (counted in C: this runs per object)."""
    values = msgspec.structs.astuple(struct)
    return len(values) - values.count(msgspec.UNSET)


def encode(value: Any, finite: bool = True) -> bytes:
    """Compact JSON. msgspec would write NaN and the infinities as null; a value that may hold them (`finite`
    False) is written by the standard library as NaN, Infinity and -Infinity, as TF Serving writes them."""
    if finite:
        return _ENCODER.encode(value)
    return json.dumps(value, separators=(",", ":")).encode()
