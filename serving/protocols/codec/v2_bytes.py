"""KServe V2's BYTES elements in binary form, framed as Triton frames them: each element's length as 4 bytes,
little-endian, then its bytes.

The one copy of the framing: the V2 codecs read and write it (`v2_tensors`), and the Python client, the load
generators and the tests write it. It imports nothing but `struct`, so a client frames its images without
importing the server, TensorFlow or grpc.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable

_LENGTH = struct.Struct("<I")
PREFIX_BYTES = _LENGTH.size  # the least an element takes, the empty one: what bounds the elements some bytes hold


class FramingError(ValueError):
    """Binary data that is not a whole number of framed elements, or holds more than were declared."""


def frame(items: Iterable[bytes]) -> bytes:
    """The elements as one BYTES tensor's binary data."""
    return b"".join(_LENGTH.pack(len(item)) + item for item in items)


def unframe(raw: bytes | memoryview, count: int) -> list[bytes]:
    """The elements of one tensor's binary data; never more than the `count` its shape declares, so a tail of
    empty elements cannot become more objects than the request claimed."""
    items: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if len(items) == count:
            raise FramingError(f"the binary data holds more than the {count} BYTES elements of its shape")
        if offset + 4 > len(raw):
            raise FramingError("truncated BYTES element length")
        (size,) = _LENGTH.unpack_from(raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise FramingError(f"BYTES element of {size} bytes overruns the binary data")
        items.append(bytes(raw[offset:offset + size]))
        offset += size
    return items
