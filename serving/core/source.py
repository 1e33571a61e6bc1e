"""The source: which versions a model's base path holds, what each holds, and a local folder to load each from.

TF Serving's FileSystemStoragePathSource, in small, and the seam where object stores come in: the repository
polls `versions` every --file_system_poll_wait_seconds, keeps each version's `fingerprint` (its files, sizes and
tags) to retry a failed one once it changes, and loads from the folder `fetch` gives, which `release` gives back
when the version is unloaded. A local base path is read where it lies. A URL (`s3://`, `gs://`, `az://`;
exported_models/storage.py) is listed in one call per poll, and a version is downloaded whole into a private
folder of --model_cache_dir, checked against the listing's sizes and renamed into place, so that a version still
being uploaded never loads half. The workers of one server share the folder: a version is downloaded once, under
a lock, and deleted once no worker holds it.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Protocol

from exported_models import model_format, storage

Fingerprint = tuple[tuple[str, int, str], ...]


class Source(Protocol):
    def versions(self, base_path: str) -> dict[int, str]:
        """The published versions and where each is; OSError (a StorageError) if the base path cannot be listed."""

    def fingerprint(self, location: str) -> Fingerprint:
        """A version's files with their sizes and tags as last listed: it changes while a copy is still arriving."""

    def fetch(self, location: str) -> str:
        """A local folder holding the version, whole; OSError if it cannot be had."""

    def release(self, location: str) -> None:
        """The version's folder is no longer needed by this worker."""


def default_cache_dir() -> str:
    """Per user, so that servers of one user share downloads and no other user can swap a model under them."""
    return os.path.join(tempfile.gettempdir(), f"petal-model-cache-{os.getuid()}")


class ModelSource:
    """The source of every base path: local ones read in place, URLs through a cache folder."""

    def __init__(self, cache_dir: str = "") -> None:
        self._cache_dir = cache_dir or default_cache_dir()
        self._lock = threading.Lock()
        self._listed: dict[str, dict[str, storage.Entry]] = {}  # a URL version's files, by location
        self._held: dict[str, tuple[str, int]] = {}  # location: (its cache folder, the shared lock held on it)

    def versions(self, base_path: str) -> dict[int, str]:
        if not storage.is_remote(base_path):
            return model_format.version_dirs(storage.local_path(base_path))
        files = storage.list_files(base_path)
        names = model_format.versions_in_listing(base_path, files)
        found = {version: storage.join(base_path, name) for version, name in names.items()}
        with self._lock:
            for version, name in names.items():
                self._listed[found[version]] = {path[len(name) + 1:]: entry for path, entry in files.items()
                                                if path.startswith(f"{name}/")}
        return found

    def fingerprint(self, location: str) -> Fingerprint:
        if storage.is_remote(location):
            with self._lock:
                files = self._listed.get(location, {})
        else:
            files = storage.list_files(location)
        return tuple(sorted((path, entry.size, entry.tag) for path, entry in files.items()))

    def fetch(self, location: str) -> str:
        if not storage.is_remote(location):
            return location
        with self._lock:
            files = dict(self._listed[location])
        folder = self._folder(location, files)
        with _locked(f"{folder}.lock", fcntl.LOCK_EX):
            if not os.path.isdir(folder):
                staging = tempfile.mkdtemp(prefix=".download-", dir=os.path.dirname(folder))
                try:
                    storage.download(location, files, staging)
                    os.rename(staging, folder)
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
            held = _lock(f"{folder}.use", fcntl.LOCK_SH)
        with self._lock:
            self._held[location] = (folder, held)
        return folder

    def release(self, location: str) -> None:
        with self._lock:
            folder, held = self._held.pop(location, ("", -1))
        if not folder:
            return
        with _locked(f"{folder}.lock", fcntl.LOCK_EX):
            os.close(held)
            try:
                unused = _lock(f"{folder}.use", fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another worker still serves it, and deletes it when it lets go
                return
            shutil.rmtree(folder, ignore_errors=True)
            for path in (f"{folder}.use", f"{folder}.lock"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            os.close(unused)

    def _folder(self, location: str, files: dict[str, storage.Entry]) -> str:
        """The cache folder of a version's exact files: another upload of the same version is another folder."""
        os.makedirs(self._cache_dir, mode=0o700, exist_ok=True)
        stat = os.lstat(self._cache_dir)
        if stat.st_uid != os.getuid() or stat.st_mode & 0o077 or not os.path.isdir(self._cache_dir):
            raise storage.StorageError(f"--model_cache_dir {self._cache_dir} must be a folder of this user's that "
                                       "no other user can write or read (mode 0700)")
        digest = hashlib.sha256(repr((location, sorted((p, e.size, e.tag) for p, e in files.items()))).encode())
        return os.path.join(self._cache_dir, f"{location.rstrip('/').rsplit('/', 1)[-1]}-{digest.hexdigest()[:24]}")


def _lock(path: str, operation: int) -> int:
    """A descriptor holding `operation` (fcntl.flock's) on the file at `path` now: one deleted by its last user
    while this waited is opened again, so that two workers never hold two files of one name."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, operation)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


@contextlib.contextmanager
def _locked(path: str, operation: int) -> Iterator[int]:
    fd = _lock(path, operation)
    try:
        yield fd
    finally:
        os.close(fd)
