"""Image checks and results that the image endpoints add on top of plain tensors.

The pixel limit reads only the image header, so a decompression bomb, a few KB of JPEG that claims 50k x 50k
pixels, is refused before TensorFlow would allocate gigabytes to decode it. JPEGs, nearly every request, have
their frame header found by walking the marker segments (about 2 us, under the GIL on every request), and JPEG XL
(which Pillow does not read) its SizeHeader; Pillow reads the other formats' headers (about 20 us), only for bytes
whose magic number is one of the formats TensorFlow decodes, so strings that are no image (serialized tf.Examples,
text) count 0 pixels at the cost of a prefix check.
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

# Pillow only reads headers here, and from the size it reads Petal refuses an image over --max_image_pixels
# (check_pixels) before anything decodes it: TensorFlow decodes, never Pillow. Pillow's own bomb check on that same
# header read, against a limit of its own (89.5 Mpx), disagreed with the flag: past it, each image printed a
# two-line DecompressionBombWarning to stderr (two WARNING records), and past twice that Pillow gave no size at all,
# so an image a higher --max_image_pixels allows was refused with a made-up count. --max_image_pixels is the one
# limit, checked on every image; this is the server's only use of Pillow.
Image.MAX_IMAGE_PIXELS = None


def jpeg_pixels(data: bytes) -> int | None:
    """Width x height from a JPEG's frame header, which precedes the first scan; None if there is none."""
    at, end = 2, len(data)
    while at + 4 <= end:
        if data[at] != 0xFF:  # libjpeg skips stray bytes before a marker ("N extraneous bytes"), and decodes on
            at = data.find(b"\xff", at)
            if at < 0:
                return None
            continue
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


# JPEG XL's width-to-height ratios by SizeHeader code (ISO/IEC 18181-1), 1 to 7.
_JXL_RATIOS = ((1, 1), (12, 10), (4, 3), (3, 2), (16, 9), (5, 4), (2, 1))
_JXL_CONTAINER = b"\x00\x00\x00\x0cJXL \r\n\x87\n"


def jxl_pixels(data: bytes) -> int | None:
    """Width x height from a JPEG XL codestream's SizeHeader, bare or in the ISO box container (its `jxlc` box,
    or its first `jxlp` part); None if there is none. Pillow reads no JPEG XL, and TensorFlow decodes it."""
    if data.startswith(_JXL_CONTAINER):
        at = len(_JXL_CONTAINER)
        while at + 8 <= len(data):
            size, kind = int.from_bytes(data[at:at + 4], "big"), data[at + 4:at + 8]
            head = 8
            if size == 1:  # a 64-bit size follows the type
                size, head = int.from_bytes(data[at + 8:at + 16], "big"), 16
            if kind in (b"jxlc", b"jxlp"):
                return jxl_pixels(data[at + head + (4 if kind == b"jxlp" else 0):at + head + 64])
            if size < head:  # 0: the box runs to the end of the file, and it is no codestream
                return None
            at += size
        return None
    if not data.startswith(b"\xff\x0a") or len(data) < 11:
        return None
    bits = int.from_bytes(data[2:11], "little")  # the SizeHeader is at most 2 x 32 + 4 bits, read LSB first
    at = 0

    def take(n: int) -> int:
        nonlocal at
        value = (bits >> at) & ((1 << n) - 1)
        at += n
        return value

    def dimension(small: bool) -> int:
        return (take(5) + 1) * 8 if small else take((9, 13, 18, 30)[take(2)]) + 1
    small = bool(take(1))
    height = dimension(small)
    ratio = take(3)
    if ratio == 0:
        return dimension(small) * height
    numerator, denominator = _JXL_RATIOS[ratio - 1]
    return height * numerator // denominator * height


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
    if data[:2] == b"\xff\x0a" or data.startswith(_JXL_CONTAINER):
        return jxl_pixels(data)
    kind = image_format(data)
    if kind is None:
        return None
    try:
        with Image.open(io.BytesIO(data), formats=[kind]) as image:
            width, height = image.size
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
