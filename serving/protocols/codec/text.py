"""Numbers and bytes as the wire formats spell them in text: versions in paths and V2 messages, header lengths,
base64.

Numbers are parsed as ASCII decimal only: `str.isdigit` accepts "²" and other Unicode digits that `int` then
rejects, which would turn a bad request into a 500.
"""
from __future__ import annotations

import binascii
import re

import pybase64

from serving.core import invalid

_ASCII_DECIMAL = re.compile(r"[0-9]+")
_WHITESPACE = re.compile(r"[ \t\n\v\f\r]")  # what absl::ascii_isspace skips in base64


def ascii_int(text: str | None) -> int | None:
    """The non-negative integer `text` spells in ASCII decimal digits, else None."""
    if text is None or not _ASCII_DECIMAL.fullmatch(text):
        return None
    return int(text)


def parse_version(text: str | None) -> int | None:
    """A model version as a path segment or a V2 message spells it; None when none is named."""
    if text is None:
        return None
    version = ascii_int(text)
    if version is None:
        raise invalid(f"Malformed request: version {text!r} is not an integer")
    return version


def b64decode(text: object, what: str) -> bytes:
    """Standard base64 as TF Serving reads it (absl::Base64Unescape): whitespace anywhere is skipped and the padding
    may be left out, but URL-safe characters, a partial padding or stray text are an error rather than silently
    wrong bytes.

    pybase64 (SIMD) rather than the standard library: a photo's base64 is tens of KB on every predict, and the
    standard library's validating decode spent about 80 us on each under the GIL, a tenth of a request's Python.
    Padded text without whitespace, what clients send, decodes at once; other text is tidied first."""
    if not isinstance(text, str):
        raise invalid(f"{what} must be a string of standard base64")
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        pass
    tidy = _WHITESPACE.sub("", text)
    core = tidy.rstrip("=")
    padding = -len(core) % 4
    if padding != 3 and len(tidy) - len(core) in (0, padding):
        try:
            return pybase64.b64decode(core + "=" * padding, validate=True)
        except (binascii.Error, ValueError):
            pass
    raise invalid(f"Unable to base64 decode {what}: the value is not standard (RFC 4648 §4) base64; URL-safe "
                  "base64 is not accepted")
