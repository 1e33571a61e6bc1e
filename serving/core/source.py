"""The file-system source: which versions exist under a model's base path, and when a failed one changed.

TF Serving's FileSystemStoragePathSource, in small: the repository polls it every
--file_system_poll_wait_seconds and feeds what it finds to the version policy.
"""
from __future__ import annotations

import os

from exported_models import model_format


def candidate_versions(base_path: str, failed: dict[int, tuple]) -> dict[int, str]:
    """The published versions and their folders as found, less those that failed to load and whose files have
    not changed since."""
    return {v: path for v, path in model_format.version_dirs(base_path).items()
            if v not in failed or files_signature(path) != failed[v]}


def files_signature(path: str) -> tuple[tuple[str, int, int], ...]:
    """Every file under a version directory with its size and mtime: it changes while a copy is still arriving."""
    entries = []
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            try:
                stat = os.stat(full)
            except OSError:  # removed while we looked: the next poll sees the difference
                continue
            entries.append((os.path.relpath(full, path), stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(entries))
