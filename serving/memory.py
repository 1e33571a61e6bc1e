"""How much memory this process may use, and from it the default budget of decoded pixels per worker.

A JPEG is small on the wire and large once decoded (a 6000 x 6000 flat colour: 0.56 MB sent, 108 MB decoded), so
memory is bounded by the pixels being decoded at once, not by bytes received. The limit is the cgroup's (v2
`memory.max`, v1 `memory.limit_in_bytes`) when there is one, else the machine's physical memory.
"""
from __future__ import annotations

import os
from pathlib import Path

from serving.cpus import CGROUP_ROOT

GiB = 1 << 30
# Decoding holds the uint8 RGB image (3 bytes a pixel) and the decoder's working rows; the resize writes only the
# model's small input. 4 bytes a pixel covers both, measured with benchmarks/memory.py.
BYTES_PER_PIXEL = 4
# Half of what the process may use goes to decoding, at most 1 GiB per worker: the rest is the model, TensorFlow,
# Python and the request bodies (a worker idles at about 650 MB with the default model).
MAX_DEFAULT_DECODE_BYTES = GiB


def available_memory(cgroup_root: str = CGROUP_ROOT) -> int:
    """Bytes this process may use: the cgroup limit when set, else physical memory."""
    for path in (Path(cgroup_root, "memory.max"), Path(cgroup_root, "memory", "memory.limit_in_bytes")):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):  # v1 reports "no limit" as a huge number
            return int(text)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_pixel_budget(memory: int, workers: int, max_image_pixels: int) -> int:
    """Decoded pixels one worker may hold at once: never less than one largest allowed image, or it could not run."""
    decode_bytes = min(MAX_DEFAULT_DECODE_BYTES, memory // (2 * max(1, workers)))
    return max(decode_bytes // BYTES_PER_PIXEL, max_image_pixels)
