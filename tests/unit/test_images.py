"""The pixel limit's header reader: JPEG frame headers found by walking markers, Pillow for other formats."""
from __future__ import annotations

import io
import math
import pathlib
import struct

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from serving.core.errors import ServingError
from serving.core.images import check_pixels, header_pixels, jpeg_pixels

# JPEG XL files made by libjxl's cjxl (`cjxl -d 0 -e 1 W x H.png`, one with --container=1) from flat PNGs: sizes
# that take each of the SizeHeader's forms (multiples of 8, each width-to-height ratio code, a 30-bit dimension).
JXL_FILES = sorted((pathlib.Path(__file__).parent.parent / "data" / "jxl").glob("*.jxl"))


def encode(mode: str, size: tuple[int, int], fmt: str = "JPEG", **options) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, "white").save(buffer, format=fmt, **options)
    return buffer.getvalue()


@pytest.mark.parametrize("mode,options", [
    ("RGB", {}),
    ("RGB", {"progressive": True}),
    ("RGB", {"optimize": True, "exif": b"Exif\x00\x00" + b"x" * 6000}),  # an APP1 segment before the frame
    ("RGB", {"restart_marker_blocks": 1}),
    ("L", {}),
    ("CMYK", {}),
], ids=["baseline", "progressive", "exif", "restart markers", "grayscale", "cmyk"])
@pytest.mark.parametrize("size", [(1, 1), (480, 360), (3001, 17)])
def test_jpeg_frame_header_gives_the_size_pillow_reads(mode, options, size):
    data = encode(mode, size, **options)
    assert jpeg_pixels(data) == size[0] * size[1]
    with Image.open(io.BytesIO(data)) as image:
        assert image.size == size


def test_a_claimed_size_is_read_without_decoding():
    data = bytearray(encode("L", (8, 8)))
    frame = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, frame + 5, 50000, 50000)  # a bomb: the header claims 2.5 Gpx
    assert jpeg_pixels(bytes(data)) == 50000 * 50000
    with pytest.raises(ServingError, match="2500000000 pixels"):
        check_pixels(np.array([bytes(data)], dtype=object), 10_000_000)


def test_fill_bytes_before_a_marker_are_skipped():
    data = encode("RGB", (64, 48))
    assert jpeg_pixels(data[:2] + b"\xff\xff\xff" + data[2:]) == 64 * 48


def test_stray_bytes_before_a_marker_are_skipped_as_libjpeg_skips_them():
    """libjpeg decodes such a file ("Corrupt JPEG data: 2 extraneous bytes before marker 0xc0"): a size read as
    none let a 144-megapixel JPEG past --max_image_pixels and count 0 against the pixel budget."""
    data = encode("RGB", (64, 48))
    frame = data.index(b"\xff\xc0")
    damaged = data[:frame] + b"\x00\x00" + data[frame:]
    assert jpeg_pixels(damaged) == 64 * 48
    assert tf.io.decode_jpeg(damaged).shape == (48, 64, 3)


@pytest.mark.parametrize("path", JXL_FILES, ids=[p.name for p in JXL_FILES])
def test_a_jpeg_xl_size_is_the_one_tensorflow_decodes(path):
    """TensorFlow's decode_image decodes JPEG XL, which Pillow does not read: unread, a 12000 x 12000 JPEG XL of
    84 KB passed --max_image_pixels."""
    data = path.read_bytes()
    height, width = tf.io.decode_image(data).shape[:2]
    assert header_pixels(data) == width * height == math.prod(map(int, path.name.split(".")[0].split("x")))


@pytest.mark.parametrize("data", [
    b"\xff\xd8",
    b"\xff\xd8\xff",
    b"\xff\xd8\xff\xe0\x00\x10JFIF",  # a segment that runs past the end
    b"\xff\xd8\xff\xda\x00\x02",  # a scan before any frame header
    b"\xff\xd8\xff\xd9",
    b"\xff\xd8garbage after the start of image",
], ids=["soi only", "lone marker", "truncated segment", "scan first", "end of image", "garbage"])
def test_malformed_jpegs_give_no_size_so_tensorflow_decides(data):
    assert jpeg_pixels(data) is None
    assert header_pixels(data) is None


def test_other_formats_are_read_by_pillow():
    assert header_pixels(encode("RGB", (300, 200), "PNG")) == 60000
    assert header_pixels(encode("RGB", (30, 20), "GIF")) == 600
    assert header_pixels(b"plain text, no image at all") is None


def test_check_pixels_passes_images_under_the_limit_and_non_images():
    values = np.array([encode("RGB", (100, 100)), b"not an image", b"short"], dtype=object)
    assert check_pixels(values, 100 * 100).tolist() == [10000, 0, 0]  # what the pixel budget counts
    grid = np.array([[encode("RGB", (10, 20)), encode("RGB", (3, 3))]], dtype=object)
    assert check_pixels(grid, 100 * 100).tolist() == [[200, 9]]
    with pytest.raises(ServingError, match="10001 pixels"):
        check_pixels(np.array([encode("RGB", (10001, 1))], dtype=object), 100 * 100)
