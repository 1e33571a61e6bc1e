"""Time from `petal serve` to AVAILABLE with the model in each object store, beside the same model on local disk.

Each store is its emulator on loopback (tests/object_stores.py: moto's S3, fake-gcs-server, Azurite), holding the
shipped model as a user would upload it; each server starts as a new pod would, with an empty --model_cache_dir and
default flags, configured by the environment alone. The rounds interleave the stores, so a machine that slows down
for a minute slows them alike; the figure is the server's own `ready: ... in N s` line, from its start to every
model AVAILABLE and both ports open, and each store's median is also given as a ratio to the local disk's.

    .venv/bin/python benchmarks/store_start.py [--rounds 3] [--model_dir exported_models/flowers]
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the emulators the tests start, started the same way here

from load_tests.launcher import running  # noqa: E402
from object_stores import Azurite, FakeGcs, MotoS3  # noqa: E402

READY = re.compile(r"^ready: .* in ([0-9.]+) s$", re.MULTILINE)


def start_seconds(base_path: str, env: dict[str, str], cache: str) -> float:
    flags = ["--model_name=flowers", f"--model_base_path={base_path}", f"--model_cache_dir={cache}"]
    with running(flags, ready=lambda server: READY.search(server.log()) is not None, cwd=str(ROOT),
                 env={"TF_CPP_MIN_LOG_LEVEL": "2", **env}) as server:
        found = READY.search(server.log())
        assert found is not None
        return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model_dir", default=str(ROOT / "exported_models" / "flowers"),
                        help="a base path of versions, uploaded to every store")
    args = parser.parse_args()
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="petal-store-start-")))
        places: dict[str, tuple[str, dict[str, str]]] = {"local disk": (args.model_dir, {})}
        for name, kind in (("S3 (moto)", MotoS3), ("GCS (fake-gcs-server)", FakeGcs), ("Azure (Azurite)", Azurite)):
            store = stack.enter_context(kind(work / kind.__name__))
            store.create_bucket("models")
            url = store.url("models", "flowers")
            store.upload_tree(args.model_dir, url)
            places[name] = (url, store.env)
        times: dict[str, list[float]] = {name: [] for name in places}
        for round_ in range(args.rounds):
            for name, (base_path, env) in places.items():
                seconds = start_seconds(base_path, env, tempfile.mkdtemp(dir=work, prefix="cache-"))
                times[name].append(seconds)
                print(f"round {round_ + 1}: {name}: ready in {seconds:.1f} s", flush=True)
        local = statistics.median(times["local disk"])
        print(f"\nstart to AVAILABLE, median of {args.rounds} interleaved rounds (each a new pod: empty cache):")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"  {name:<22} {median:5.1f} s ({min(values):.1f}-{max(values):.1f})  {median / local:.2f}x local")


if __name__ == "__main__":
    main()
