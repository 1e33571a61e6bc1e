"""A fresh pod on this machine: `petal serve` alone in a memory cgroup that it sees as its own, started with a cold
page cache, so that it is charged for every page it reads, as a new pod is (tests/e2e/test_manifests.py,
benchmarks/memory.py --pod_limit).

The cgroup is a child of this process's, with the limit set; the server starts in a private mount namespace with
the child bound over /sys/fs/cgroup/memory (v1) or /sys/fs/cgroup (v2), where a container finds its own.

Dropping the page cache is not enough on a machine that runs other TensorFlow processes (another test process,
another server): the kernel keeps the pages of a library that any process maps, charged to that process's cgroup,
and the server would use them free of charge. TensorFlow's libraries are 1.4 GB, of which a server touches about
600 MB. So the server imports a TensorFlow of its own: a tree of links to the installed package, but with copies
of its shared objects, which nothing else maps (they find each other through $ORIGIN, the folder they were opened
from: the copy's). It is put first on the server's PYTHONPATH.

One pod at a time on a machine (a lock in /var/tmp): two would share neither pages nor a cold cache, and each copy
needs 1.4 GB of disk, which is checked before it is made.

Needs root, to create the cgroup, mount and drop the page cache; `unavailable()` says why it cannot be done.
"""
from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from serving.host.memory import CgroupMemory, read_cgroup_v1, read_cgroup_v2

CGROUP_FS = Path("/sys/fs/cgroup")
DISK_TMP = "/var/tmp"  # the copies must be on a disk, whose pages can be dropped (a tmpfs's cannot)
LOCK = Path(DISK_TMP) / "petal-pod.lock"
DISK_MARGIN = 256 * 2**20  # what the copy leaves free on the disk, for everything else that writes there
SAMPLE_S = 0.005  # the working set has no high-water mark of its own: it is sampled this often


def own_cgroup() -> tuple[int, Path] | None:
    """This process's memory cgroup, as (version, folder), or None when it has none."""
    unified = CGROUP_FS / "cgroup.controllers"  # there when /sys/fs/cgroup is v2's single hierarchy
    v2_memory = unified.exists() and "memory" in unified.read_text().split()
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return 1, CGROUP_FS / "memory" / path.lstrip("/")
        if controllers == "" and v2_memory:
            return 2, CGROUP_FS / path.lstrip("/")
    return None


def unavailable() -> str | None:
    """Why a fresh pod cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root, to create a memory cgroup, mount it and drop the page cache"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux), for the server's private mount namespace"
    found = own_cgroup()
    if found is None:
        return "this process is in no memory cgroup (neither a v1 memory hierarchy nor v2 with its memory controller)"
    version, parent = found
    probe = parent / f"petal-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError as error:
        return f"cannot create a child of the memory cgroup {parent}: {error}"
    try:
        if not (probe / ("memory.max" if version == 2 else "memory.limit_in_bytes")).exists():
            return f"{parent} does not give its children the memory controller (cgroup.subtree_control)"
    finally:
        probe.rmdir()
    if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        return "cannot drop the page cache (/proc/sys/vm/drop_caches is not writable)"
    return None


@dataclass
class Peaks:
    """What the cgroup reached while it was sampled (bytes), and its counts at the end."""
    working_set: int = 0
    usage: int = 0
    last: CgroupMemory | None = None


@dataclass
class Pod:
    """A memory cgroup of `limit` bytes (`folder`, on this machine's cgroup file system) and how to start a server
    in it: pass `wrapper` and `env` to tests/server_harness.run_server."""
    version: int
    folder: Path
    limit: int
    env: dict[str, str] = field(default_factory=dict)

    @property
    def wrapper(self) -> list[str]:
        """Joins the cgroup, binds it where the server looks for its own, and execs the server."""
        seen_as = CGROUP_FS / "memory" if self.version == 1 else CGROUP_FS
        join = 'echo $$ > "$0/cgroup.procs" && mount --bind "$0" "$1" && shift && exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", join, str(self.folder), str(seen_as)]

    def read(self) -> CgroupMemory:
        return (read_cgroup_v1 if self.version == 1 else read_cgroup_v2)(self.folder)

    @contextmanager
    def sampled(self) -> Iterator[Peaks]:
        """The peaks of the working set and the usage while the block runs, sampled; on v1 the usage's exactly too,
        from the kernel's high-water mark reset at the start (v2's memory.peak can be reset only for its writer)."""
        high_water = self.folder / "memory.max_usage_in_bytes"
        if self.version == 1:
            high_water.write_text("0\n")  # back to the usage now
        peaks, done = Peaks(), threading.Event()

        def sample() -> None:
            while True:
                now = self.read()
                peaks.working_set = max(peaks.working_set, now.working_set)
                peaks.usage = max(peaks.usage, now.usage)
                peaks.last = now
                if done.wait(SAMPLE_S):
                    return
        sampler = threading.Thread(target=sample, name="pod-sampler", daemon=True)
        sampler.start()
        try:
            yield peaks
        finally:
            done.set()
            sampler.join()
            if self.version == 1:
                peaks.usage = max(peaks.usage, int(high_water.read_text()))


def private_tensorflow(folder: Path) -> Path:
    """A TensorFlow package in `folder` that no other process maps: links to the installed one, but for copies of
    its shared objects. Returns what to put on PYTHONPATH."""
    spec = importlib.util.find_spec("tensorflow")
    assert spec is not None and spec.submodule_search_locations, "TensorFlow is not installed"
    package = Path(spec.submodule_search_locations[0])
    libraries = {path for path in package.rglob("*.so*") if path.is_file()}
    needed, free = sum(path.stat().st_size for path in libraries), shutil.disk_usage(folder).free
    if needed + DISK_MARGIN > free:
        raise OSError(f"a fresh pod copies TensorFlow's libraries ({needed / 2**30:.1f} GiB) to {folder}, "
                      f"which has {free / 2**30:.1f} GiB free")
    holders = {parent for path in libraries for parent in path.parents}
    _mirror(package, folder / "tensorflow", libraries, holders)
    return folder


def _mirror(source: Path, target: Path, libraries: set[Path], holders: set[Path]) -> None:
    """`source` as `target`: a folder that holds a shared object is a real folder (a library finds its siblings
    through $ORIGIN/.., which must stay in the copy) with the libraries copied; anything else is a link."""
    target.mkdir(parents=True)
    for entry in source.iterdir():
        if entry in holders:
            _mirror(entry, target / entry.name, libraries, holders)
        elif entry in libraries:
            shutil.copy2(entry, target / entry.name)
        else:
            (target / entry.name).symlink_to(entry)


def drop_page_cache() -> None:
    """Every clean page nothing maps leaves memory: the machine's other processes read theirs again from disk."""
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


@contextmanager
def fresh_pod(limit: int) -> Iterator[Pod]:
    """A pod of `limit` bytes with a cold page cache, for one server; removed afterwards, with anything left in
    it. Call `unavailable()` first."""
    found = own_cgroup()
    assert found is not None, unavailable()
    version, parent = found
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, and by the kernel if this process dies
        folder = Path(tempfile.mkdtemp(prefix="petal-pod-", dir=DISK_TMP))
        cgroup = parent / folder.name
        cgroup.mkdir()
        try:
            if version == 1:
                (cgroup / "memory.limit_in_bytes").write_text(f"{limit}\n")
            else:
                (cgroup / "memory.max").write_text(f"{limit}\n")
                if (cgroup / "memory.swap.max").exists():
                    (cgroup / "memory.swap.max").write_text("0\n")
            pod = Pod(version, cgroup, limit, {"PYTHONPATH": str(private_tensorflow(folder))})
            drop_page_cache()
            yield pod
        finally:
            _empty(cgroup)
            shutil.rmtree(folder, ignore_errors=True)


def _empty(cgroup: Path, timeout_s: float = 30.0) -> None:
    """Kill what the server left in the cgroup (only processes started in it), then remove it."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = [int(pid) for pid in (cgroup / "cgroup.procs").read_text().split()]
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        try:
            cgroup.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
