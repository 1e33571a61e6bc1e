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
import math
import struct
from typing import NamedTuple

import numpy as np
from PIL import Image, UnidentifiedImageError

from serving.core.errors import invalid
from serving.memory_costs import BYTES_PER_PIXEL

# Start-of-frame markers (baseline, progressive, lossless, arithmetic); not C4 (DHT), C8 (JPG) or CC (DAC).
_JPEG_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}  # RSTn and TEM carry no length
_JPEG_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
# The other formats tf.io.decode_image decodes (besides JPEG and WebP's RIFF container), by their magic numbers.
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"BM", "BMP"))

# Pillow only reads headers here, and from the size it reads Petal refuses an image over --max_image_pixels
# (check_pixels) before anything decodes it: TensorFlow decodes, never Pillow. Pillow's own bomb check on that same
# header read, against a limit of its own (89.5 Mpx), disagreed with the flag: past it, each image printed a
# two-line DecompressionBombWarning to stderr (two WARNING records), and past twice that Pillow gave no size at all,
# so an image a higher --max_image_pixels allows was refused with a made-up count. --max_image_pixels is the one
# limit, checked on every image; this is the server's only use of Pillow.
Image.MAX_IMAGE_PIXELS = None


class JpegFrame(NamedTuple):
    width: int
    height: int
    coefficients: int  # what a progressive decode also holds, in pixels of BYTES_PER_PIXEL (0 for a baseline one)

    def decoded(self, scaled_to: tuple[int, int] | None) -> int:
        """The pixels decoding it makes: all of them, or, in a signature that decodes a JPEG at the smallest DCT
        scaling still at least `scaled_to` (height, width; training/preprocessing.decode_at_least), the
        1/ratio image, each side rounded up as libjpeg rounds it."""
        ratio = jpeg_ratio(self.height, self.width, *scaled_to) if scaled_to else 1
        return -(-self.width // ratio) * -(-self.height // ratio)


def jpeg_ratio(height: int, width: int, min_height: int, min_width: int) -> int:
    """The DCT scaling (1, 2, 4 or 8) that training/preprocessing.decode_at_least decodes a JPEG of this size at,
    for the memory budget: the largest whose image is still at least min_height x min_width."""
    return next((ratio for ratio in (8, 4, 2)
                 if -(-height // ratio) >= min_height and -(-width // ratio) >= min_width), 1)


def jpeg_frame(data: bytes) -> JpegFrame | None:
    """A JPEG's size and what decoding it holds besides its pixels, from its frame header (None if there is
    none): a progressive JPEG's decoder also keeps every DCT coefficient of the image until its last scan, 2 bytes
    for each sample of each component (6 more bytes a pixel at 4:4:4, 3 at 4:2:0), at full size whatever the scaling
    it decodes at, where a baseline one decodes a row of blocks at a time (measured: 36 Mpx at 4:4:4 took 111 MB
    baseline and 317 MB progressive)."""
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
        elif marker == 0x00:  # a stuffed zero: no marker, and libjpeg's next_marker reads on past it
            at += 2
        elif marker in _JPEG_STANDALONE:
            at += 2
        elif marker in _JPEG_FRAMES:
            if at + 10 > end:
                return None
            height, width, components = struct.unpack_from(">HHB", data, at + 5)
            pixels = width * height
            if marker not in _JPEG_PROGRESSIVE:
                return JpegFrame(width, height, 0)
            sampling = [data[i] for i in range(at + 11, min(at + 10 + 3 * components, end), 3)]
            if not sampling or not all(sampling):
                return JpegFrame(width, height, pixels * 2 * max(1, components) // BYTES_PER_PIXEL)
            largest = max(s >> 4 for s in sampling) * max(s & 15 for s in sampling)
            samples = sum((s >> 4) * (s & 15) for s in sampling) / largest  # per pixel, over the components
            return JpegFrame(width, height, math.ceil(pixels * 2 * samples / BYTES_PER_PIXEL))
        elif marker in (0xD9, 0xDA):  # end of image, or a scan before any frame header
            return None
        else:
            at += 2 + int.from_bytes(data[at + 2:at + 4], "big")
    return None


# JPEG XL's width-to-height ratios by SizeHeader code (ISO/IEC 18181-1), 1 to 7.
_JXL_RATIOS = ((1, 1), (12, 10), (4, 3), (3, 2), (16, 9), (5, 4), (2, 1))
_JXL_CONTAINER = b"\x00\x00\x00\x0cJXL \r\n\x87\n"


def jxl_codestream_start(data: bytes, length: int = 64) -> bytes:
    """The first `length` bytes of the codestream in JPEG XL's ISO box container: its `jxlc` box, or its `jxlp`
    parts joined (each after its 4-byte index) as libjxl joins them, each box read within its own size, so that a
    part of a few bytes cannot make the next box's header read as the SizeHeader."""
    at, stream = len(_JXL_CONTAINER), b""
    while at + 8 <= len(data) and len(stream) < length:
        size, kind = int.from_bytes(data[at:at + 4], "big"), data[at + 4:at + 8]
        head = 8
        if size == 1:  # a 64-bit size follows the type
            size, head = int.from_bytes(data[at + 8:at + 16], "big"), 16
        end = len(data) if size == 0 else at + size  # 0: the box runs to the end of the file
        if end < at + head:
            break
        if kind == b"jxlc":
            return (stream + data[at + head:end])[:length]
        if kind == b"jxlp":
            stream += data[at + head + 4:end]
        at = end
    return stream[:length]


def jxl_pixels(data: bytes) -> int | None:
    """Width x height from a JPEG XL codestream's SizeHeader, bare or in the ISO box container; None if there is
    none. Pillow reads no JPEG XL, and TensorFlow decodes it."""
    if data.startswith(_JXL_CONTAINER):
        data = jxl_codestream_start(data)
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


def header_cost(data: bytes, scaled_to: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """An image's pixels, which --max_image_pixels limits, and what decoding it holds in pixels of BYTES_PER_PIXEL,
    which the pixel budget charges, from the header alone: an animated GIF's every frame (TensorFlow's GIF decoder
    reads them all, even when it keeps only the first), a progressive JPEG's coefficients (jpeg_frame), and a JPEG
    only at the size it decodes at where the signature scales it (`scaled_to`, JpegFrame.decoded). None when the
    bytes are no image Petal recognises (TF then decides).

    A JPEG or JPEG XL whose size Petal cannot read is refused, not counted as none: its decoder could read one
    where Petal did not, and decode an image past every limit."""
    if data[:2] == b"\xff\xd8":
        frame = jpeg_frame(data)
        if frame is None:
            raise invalid("Invalid JPEG data: no image size in its header")
        return frame.width * frame.height, frame.decoded(scaled_to) + frame.coefficients
    if data[:2] == b"\xff\x0a" or data.startswith(_JXL_CONTAINER):
        pixels = jxl_pixels(data)
        if pixels is None:
            raise invalid("Invalid JPEG XL data: no image size in its header")
        return pixels, pixels
    kind = image_format(data)
    if kind is None:
        return None
    try:
        with Image.open(io.BytesIO(data), formats=[kind]) as image:
            width, height = image.size
            # n_frames walks the frames' headers, decoding none
            frames = getattr(image, "n_frames", 1) if kind == "GIF" else 1
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
        return None
    return width * height * frames, width * height * frames


def check_pixels(values: np.ndarray, limit: int, scaled_to: tuple[int, int] | None = None) -> np.ndarray:
    """What decoding each element of a string tensor holds, in pixels (header_cost, with the input's JPEG scaling
    if its signature has one; 0 for what is no image), for the worker's pixel budget, refusing any image of more
    than `limit` pixels: every pixel of the image, whatever size it decodes at, since a scaled decode still reads
    every block of it."""
    pixels = np.zeros(values.shape, dtype=np.int64)
    flat = pixels.reshape(-1)
    for i, data in enumerate(values.reshape(-1)):
        if isinstance(data, bytes) and len(data) > 8:
            cost = header_cost(data, scaled_to)
            if cost is None:
                continue
            if cost[0] > limit:
                raise invalid(f"Image too large: {cost[0]} pixels exceeds the limit of {limit} "
                              "(--max_image_pixels)")
            flat[i] = cost[1]
    return pixels


def top_k(probabilities: np.ndarray, class_names: list[str], k: int) -> list[list[tuple[str, float]]]:
    """Per row, the k best (label, score) pairs, best first; class indices stand in for missing class names."""
    k = max(1, min(k, probabilities.shape[1]))
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
    width = probabilities.shape[1]
    names = class_names if len(class_names) == width else [str(i) for i in range(width)]
    return [[(names[i], float(row[i])) for i in indices] for row, indices in zip(probabilities, order, strict=True)]
