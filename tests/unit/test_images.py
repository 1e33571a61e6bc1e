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
from serving.core.images import check_pixels, header_cost, jpeg_frame
from training.preprocessing import decode_at_least

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
    assert jpeg_frame(data)[:2] == size
    with Image.open(io.BytesIO(data)) as image:
        assert image.size == size


def test_a_claimed_size_is_read_without_decoding():
    data = bytearray(encode("L", (8, 8)))
    frame = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, frame + 5, 50000, 50000)  # a bomb: the header claims 2.5 Gpx
    assert jpeg_frame(bytes(data))[:2] == (50000, 50000)
    with pytest.raises(ServingError, match="2500000000 pixels"):
        check_pixels(np.array([bytes(data)], dtype=object), 10_000_000)


def test_fill_bytes_before_a_marker_are_skipped():
    data = encode("RGB", (64, 48))
    assert jpeg_frame(data[:2] + b"\xff\xff\xff" + data[2:])[:2] == (64, 48)


def test_stray_bytes_before_a_marker_are_skipped_as_libjpeg_skips_them():
    """libjpeg decodes such a file ("Corrupt JPEG data: 2 extraneous bytes before marker 0xc0"): a size read as
    none let a 144-megapixel JPEG past --max_image_pixels and count 0 against the pixel budget."""
    data = encode("RGB", (64, 48))
    frame = data.index(b"\xff\xc0")
    damaged = data[:frame] + b"\x00\x00" + data[frame:]
    assert jpeg_frame(damaged)[:2] == (64, 48)
    assert tf.io.decode_jpeg(damaged).shape == (48, 64, 3)


@pytest.mark.parametrize("path", JXL_FILES, ids=[p.name for p in JXL_FILES])
def test_a_jpeg_xl_size_is_the_one_tensorflow_decodes(path):
    """TensorFlow's decode_image decodes JPEG XL, which Pillow does not read: unread, a 12000 x 12000 JPEG XL of
    84 KB passed --max_image_pixels."""
    data = path.read_bytes()
    height, width = tf.io.decode_image(data).shape[:2]
    pixels = width * height
    assert pixels == math.prod(map(int, path.name.split(".")[0].split("x")))  # the size its name says
    assert header_cost(data) == (pixels, pixels)


@pytest.mark.parametrize("data", [
    b"\xff\xd8",
    b"\xff\xd8\xff",
    b"\xff\xd8\xff\xe0\x00\x10JFIF",  # a segment that runs past the end
    b"\xff\xd8\xff\xda\x00\x02",  # a scan before any frame header
    b"\xff\xd8\xff\xd9",
    b"\xff\xd8garbage after the start of image",
], ids=["soi only", "lone marker", "truncated segment", "scan first", "end of image", "garbage"])
def test_a_jpeg_without_a_size_is_refused_not_counted_as_none(data):
    """libjpeg cannot decode these either; refused, no JPEG whose size Petal missed passes as 0 pixels."""
    assert jpeg_frame(data) is None
    with pytest.raises(ServingError, match="Invalid JPEG data: no image size in its header"):
        header_cost(data)


def test_a_stuffed_zero_before_a_marker_is_read_past_as_libjpeg_reads_past_it():
    """`FF 00` is no marker segment: libjpeg's next_marker skips it and finds the frame header after it. Read as a
    segment of length 0x7F7F, it made Petal jump past the frame header and count a 64-megapixel JPEG as none."""
    data = encode("RGB", (64, 48))
    stuffed = data[:2] + b"\xff\x00\x7f\x7f" + data[2:]
    assert jpeg_frame(stuffed)[:2] == (64, 48)
    assert tf.io.decode_jpeg(stuffed).shape == (48, 64, 3)


def test_a_jpeg_xl_split_into_parts_is_read_across_them():
    """The codestream in `jxlp` boxes is joined as libjxl joins it: a first part of two bytes made Petal read the
    next box's header as the SizeHeader (72963 pixels for a 1920 x 1080 image)."""
    whole = next(p for p in JXL_FILES if p.name.startswith("1920x1080")).read_bytes()
    codestream = whole if whole[:2] == b"\xff\x0a" else None
    assert codestream is not None, "the fixture is a bare codestream"

    def box(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", 8 + len(payload)) + kind + payload
    container = b"\x00\x00\x00\x0cJXL \r\n\x87\n" + box(b"ftyp", b"jxl \x00\x00\x00\x00jxl ")
    split = container + box(b"jxlp", bytes(4) + codestream[:2]) + box(b"jxlp", b"\x80\x00\x00\x01" + codestream[2:])
    assert header_cost(split) == (1920 * 1080, 1920 * 1080)
    assert tuple(tf.io.decode_image(split).shape[:2]) == (1080, 1920)


def test_an_animated_gif_counts_every_frame_tensorflow_reads():
    """TensorFlow's GIF decoder holds every frame, even with expand_animations=False: 12 frames of 4000 x 4000 in
    165 KB grew a worker by 182 MB while one frame was counted."""
    rng = np.random.default_rng(0)  # frames that differ, which Pillow keeps apart
    frames = [Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)) for _ in range(12)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    assert tf.io.decode_gif(buffer.getvalue()).shape[0] == 12
    assert header_cost(buffer.getvalue()) == (12 * 40 * 30, 12 * 40 * 30)  # what the limit and the budget count
    with pytest.raises(ServingError, match="14400 pixels"):
        check_pixels(np.array([buffer.getvalue()], dtype=object), 40 * 30 * 11)


def test_other_formats_are_read_by_pillow():
    assert header_cost(encode("RGB", (300, 200), "PNG")) == (60000, 60000)
    assert header_cost(encode("RGB", (30, 20), "GIF")) == (600, 600)
    assert header_cost(b"plain text, no image at all") is None


def test_check_pixels_passes_images_under_the_limit_and_non_images():
    values = np.array([encode("RGB", (100, 100)), b"not an image", b"short"], dtype=object)
    assert check_pixels(values, 100 * 100).tolist() == [10000, 0, 0]  # what the pixel budget counts
    grid = np.array([[encode("RGB", (10, 20)), encode("RGB", (3, 3))]], dtype=object)
    assert check_pixels(grid, 100 * 100).tolist() == [[200, 9]]
    with pytest.raises(ServingError, match="10001 pixels"):
        check_pixels(np.array([encode("RGB", (10001, 1))], dtype=object), 100 * 100)


@pytest.mark.parametrize("subsampling, charged", [(0, 2.5), (2, 1.75)], ids=["4:4:4", "4:2:0"])
def test_a_progressive_jpeg_is_charged_for_the_coefficients_its_decoder_keeps(subsampling, charged):
    """2 bytes for each sample of each component, on top of BYTES_PER_PIXEL a pixel: a 36 Mpx progressive JPEG
    at 4:4:4 took 317 MB to decode where its baseline twin took 111 MB and 144 MB was charged. The limit counts
    pixels alike."""
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8))
    encoded = {}
    for progressive in (False, True):
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", progressive=progressive, subsampling=subsampling)
        encoded[progressive] = buffer.getvalue()
    assert check_pixels(np.array([encoded[False]], dtype=object), 64 * 48).tolist() == [64 * 48]
    assert check_pixels(np.array([encoded[True]], dtype=object), 64 * 48).tolist() == [int(64 * 48 * charged)]
    assert header_cost(encoded[True])[0] == 64 * 48


def test_a_jpeg_is_charged_at_the_dct_scaling_its_signature_decodes_it_at():
    """A 64x64 model's signature decodes a 1024x768 JPEG at 1/8 (128x96), a 480x360 one at 1/4 and a 40x30 one in
    full; the limit still counts every pixel of the image."""
    jpegs = np.array([encode("RGB", (1024, 768)), encode("RGB", (480, 360)), encode("RGB", (40, 30))], dtype=object)
    assert check_pixels(jpegs, 1024 * 768, (64, 64)).tolist() == [128 * 96, 120 * 90, 40 * 30]
    assert check_pixels(jpegs, 1024 * 768).tolist() == [1024 * 768, 480 * 360, 40 * 30]
    with pytest.raises(ServingError, match="786432 pixels"):
        check_pixels(jpegs, 1024 * 768 - 1, (64, 64))
    png = np.array([encode("RGB", (1024, 768), "PNG")], dtype=object)
    assert check_pixels(png, 1024 * 768, (64, 64)).tolist() == [1024 * 768], "only JPEGs decode scaled"


@pytest.mark.parametrize("progressive", [False, True])
def test_the_charge_is_the_size_the_graph_decodes(progressive):
    """This module's rule, in Python, against training/preprocessing.decode_at_least's in the graph, on each side of
    every scaling's threshold for 64 px (126 and 127 px for 1/2, 252 and 253 for 1/4, 504 and 505 for 1/8); a
    progressive JPEG's coefficients are kept at full size whatever it decodes at."""
    for width, height in [(126, 126), (127, 127), (252, 300), (253, 253), (504, 1000), (505, 505), (2000, 130)]:
        data = encode("RGB", (width, height), progressive=progressive)
        decoded = decode_at_least(data, 64, 64).shape
        scaled, full = header_cost(data, (64, 64)), header_cost(data)
        assert scaled is not None and full is not None
        assert (scaled[0], scaled[1] - decoded[0] * decoded[1]) == (full[0], full[1] - width * height), (width, height)
