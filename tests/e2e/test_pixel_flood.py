"""A pixel flood against a real server: large flat-colour JPEGs (cheap on the wire, 108 MB each decoded) from
several clients at once, over REST JSON, V2 binary, multipart `:classify_image` and gRPC. The worker's memory
budget (serving/core/budget.py) keeps the server's peak within its idle size plus the budget (and the 15% its
estimate may be off by); every request is answered 200, 503 or 504; and once the flood is over nothing of the budget
is still held. A progressive JPEG's decoder keeps the whole image's DCT coefficients however small it decodes, so a
flood of those is held to the same bound, its images decoding one at a time in the pixel share (each for a second
or more, so that most requests run out of time waiting: 504)."""
import time

import pytest

from load_tests.pixel_flood import flat_jpeg, flood, flood_requests, reset_peak, status_kb
from server_harness import memory_held, run_server, tiny_model_base, worker_pid

SIDE = 6000  # 36 Mpx: under the default --max_image_pixels
MB = 2**20
# 144 MB of it kept for decoding one 36 Mpx image, 112 MB for request bodies (each charged 4 bytes for a byte sent)
BUDGET = 256 * MB
# 8 requests of 10 images (7 MB of JSON each), more than the budget's 112 MB for bodies holds over any protocol.
# benchmarks/memory.py sends 32 a request, which takes longer over REST (one image decodes at a time either way);
# gRPC gets those 32 (17 MB a message), since what grpcio receives before the budget can refuse it grows with them.
# Each admitted request decodes its images one at a time (32 of 36 Mpx over gRPC: 15 s was too short for any of
# them on a loaded 2-core machine, every answer 503 or 504); the deadline only bounds a server that never answers.
CLIENTS, IMAGES, GRPC_IMAGES = 8, 10, 32
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def image() -> bytes:
    return flat_jpeg(SIDE)


@pytest.fixture(scope="module")
def progressive_image() -> bytes:
    return flat_jpeg(SIDE, progressive=True)


@pytest.fixture(scope="module")
def server():
    with run_server("--model_name=flowers",
                    f"--model_base_path={tiny_model_base()}", "--tensorflow_inter_op_parallelism=8",
                    f"--max_image_pixels={SIDE * SIDE}", f"--memory_budget_bytes={BUDGET}",
                    "--rest_api_timeout_in_ms=15000") as server:
        pid = worker_pid(server.proc.pid)
        server.worker = pid
        server.idle = status_kb(pid, "VmRSS") * 1024
        yield server


@pytest.mark.parametrize("protocol", ["rest", "v2", "multipart", "grpc"])
def test_the_memory_budget_bounds_the_server_under_a_flood(server, image, protocol):
    grpc = protocol == "grpc"
    statuses = flood_within_budget(server, flood_requests(protocol, server, image, GRPC_IMAGES if grpc else IMAGES,
                                                          CLIENTS, TIMEOUT_S))
    assert 200 in statuses and 503 in statuses, f"some served, and the flood is larger than the budget: {statuses}"


@pytest.mark.parametrize("protocol", ["rest", "grpc"])
def test_the_memory_budget_bounds_the_server_under_a_progressive_flood(server, progressive_image, protocol):
    grpc = protocol == "grpc"
    statuses = flood_within_budget(server, flood_requests(protocol, server, progressive_image,
                                                          GRPC_IMAGES if grpc else IMAGES, CLIENTS, TIMEOUT_S))
    assert {503, 504} & set(statuses), f"the flood is larger than the budget: {statuses}"


def flood_within_budget(server, sends) -> dict[int, int]:
    """Send a flood; every request is answered, the worker's peak stays within its idle size plus the
    budget and its slack, and once the flood is over nothing of the budget is held. How many got each status."""
    reset_peak(server.worker)
    statuses = flood(sends)
    grown = status_kb(server.worker, "VmHWM") * 1024 - server.idle
    assert sum(statuses.values()) == len(sends), "every request is answered"
    assert set(statuses) <= {200, 503, 504}, statuses
    assert grown <= BUDGET * 1.15, f"the worker grew by {grown / MB:.0f} MB over its idle size"
    # a request answered 504 may leave its image decoding (a TF call cannot be stopped), which then gives it back
    deadline = time.monotonic() + 30
    while memory_held(server) != {"bodies": 0, "pixels": 0} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert memory_held(server) == {"bodies": 0, "pixels": 0}, "every request gave back what it held"
    return statuses
