"""Image checks and results that the image endpoints add on top of plain tensors.

The pixel limit reads only the image header (Pillow parses markers lazily), so a decompression bomb, a few KB of
JPEG that claims 50k x 50k pixels, is refused before TensorFlow would allocate gigabytes to decode it.
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image, UnidentifiedImageError

from serving.errors import invalid


def header_pixels(data: bytes) -> int | None:
    """Width x height from the header alone; None when Pillow does not recognise the bytes (TF then decides)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except Image.DecompressionBombError:
        return 1 << 62  # Pillow itself judged it a bomb (over twice its own limit)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return None
    return width * height


def check_pixels(values: np.ndarray, limit: int) -> None:
    """Refuse any element of a string tensor that is an image larger than `limit` pixels."""
    for data in values.reshape(-1):
        if isinstance(data, bytes) and len(data) > 8:
            pixels = header_pixels(data)
            if pixels is not None and pixels > limit:
                raise invalid(f"Image too large: {pixels} pixels exceeds the limit of {limit} "
                              "(--max_image_pixels)")


def top_k(probabilities: np.ndarray, labels: list[str], k: int) -> list[list[tuple[str, float]]]:
    """Per row, the k best (label, score) pairs, best first; class indices stand in for missing labels."""
    k = max(1, min(k, probabilities.shape[1]))
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
    names = labels if len(labels) == probabilities.shape[1] else [str(i) for i in range(probabilities.shape[1])]
    return [[(names[i], float(row[i])) for i in indices] for row, indices in zip(probabilities, order)]
