"""Image checks and results that the image endpoints add on top of plain tensors.

The pixel limit reads only the image header, so a decompression bomb, a few KB of JPEG that claims 50k x 50k
pixels, is refused before TensorFlow would allocate gigabytes to decode it. JPEGs, nearly every request, have
their frame header found by walking the marker segments (about 2 us, under the GIL on every request); Pillow
reads the other formats' headers (about 20 us), only for bytes whose magic number is one of the formats TensorFlow
decodes, so strings that are no image (serialized tf.Examples, text) count 0 pixels at the cost of a prefix check.
"""
from __future__ import annotations

import io
import struct

import numpy as np
from PIL import Image, UnidentifiedImageError

from serving.core.errors import invalid

# Start-of-frame markers (baseline, progressive, lossless, arithmetic); not C4 (DHT), C8 (JPG) or CC (DAC).
_JPEG_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}  # RSTn and TEM carry no length
# The other formats tf.io.decode_image decodes (besides JPEG and WebP's RIFF container), by their magic numbers.
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"BM", "BMP"))


def jpeg_pixels(data: bytes) -> int | None:
    """Width x height from a JPEG's frame header, which precedes the first scan; None if there is none."""
    at, end = 2, len(data)
    while at + 4 <= end:
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte before a marker
            at += 1
        elif marker in _JPEG_STANDALONE:
            at += 2
        elif marker in _JPEG_FRAMES:
            if at + 9 > end:
                return None
            height, width = struct.unpack_from(">HH", data, at + 5)
            return width * height
        elif marker in (0xD9, 0xDA):  # end of image, or a scan before any frame header
            return None
        else:
            at += 2 + int.from_bytes(data[at + 2:at + 4], "big")
    return None


def image_format(data: bytes) -> str | None:
    """The Pillow format of bytes that start like an image tf.io.decode_image decodes, by their magic number;
    None for anything else (a serialized tf.Example, text), which costs no parsing at all."""
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    return "WEBP" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else None


def header_pixels(data: bytes) -> int | None:
    """Width x height from the header alone; None when the bytes are no image Petal recognises (TF then
    decides)."""
    if data[:2] == b"\xff\xd8":
        return jpeg_pixels(data)
    kind = image_format(data)
    if kind is None:
        return None
    try:
        with Image.open(io.BytesIO(data), formats=[kind]) as image:
            width, height = image.size
    except Image.DecompressionBombError:
        return 1 << 62  # Pillow itself judged it a bomb (over twice its own limit)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return None
    return width * height


def check_pixels(values: np.ndarray, limit: int) -> np.ndarray:
    """The pixels of each element of a string tensor (0 for what is no image), refusing any image larger than
    `limit`: what decoding it will hold in memory, for the worker's pixel budget."""
    pixels = np.zeros(values.shape, dtype=np.int64)
    flat = pixels.reshape(-1)
    for i, data in enumerate(values.reshape(-1)):
        if isinstance(data, bytes) and len(data) > 8:
            count = header_pixels(data)
            if count is not None and count > limit:
                raise invalid(f"Image too large: {count} pixels exceeds the limit of {limit} "
                              "(--max_image_pixels)")
            flat[i] = count or 0
    return pixels


def top_k(probabilities: np.ndarray, class_names: list[str], k: int) -> list[list[tuple[str, float]]]:
    """Per row, the k best (label, score) pairs, best first; class indices stand in for missing class names."""
    k = max(1, min(k, probabilities.shape[1]))
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
    width = probabilities.shape[1]
    names = class_names if len(class_names) == width else [str(i) for i in range(width)]
    return [[(names[i], float(row[i])) for i in indices] for row, indices in zip(probabilities, order, strict=True)]
