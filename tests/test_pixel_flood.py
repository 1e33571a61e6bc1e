"""A pixel flood against a real server: large flat-colour JPEGs (cheap on the wire, 108 MB each decoded) from
several clients at once. The worker's pixel budget keeps its peak memory near one image's decode, and every
request is answered."""
import threading

import pytest
import requests

from server_harness import b64, flat_jpeg, reset_peak, run_server, status_kb, tiny_model_base, worker_pid

pytestmark = pytest.mark.slow
SIDE = 6000  # 36 Mpx: under the default --max_image_pixels
MB = 2**20


def test_the_pixel_budget_bounds_a_workers_memory_under_a_flood():
    image = flat_jpeg(SIDE)
    body = {"instances": [b64(image)] * 4}
    with run_server(f"--model_base_path={tiny_model_base()}", "--port=0", "--enable_batching=false",
                    "--tensorflow_inter_op_parallelism=8",
                    f"--max_image_pixels={SIDE * SIDE}", f"--max_inflight_pixels={SIDE * SIDE}") as server:
        pid = worker_pid(server.proc.pid)
        reset_peak(pid)
        idle = status_kb(pid, "VmRSS") * 1024
        statuses = []

        def client() -> None:
            statuses.append(requests.post(server.rest_url + "/v1/models/flowers:predict", json=body,
                                          timeout=300).status_code)
        threads = [threading.Thread(target=client) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        grown = status_kb(pid, "VmHWM") * 1024 - idle
    assert statuses == [200] * 4
    # With 8 inter-op threads (a larger machine's TF pool) and no budget, the 16 images decode up to 8 at a time
    # and the worker grows by about 900 MB; the budget admits one 36 Mpx image at a time (about 470 MB measured,
    # the allocator keeping some of what decoding freed).
    assert grown < 650 * MB, f"the worker grew by {grown / MB:.0f} MB"
