"""What a serving worker process is made of: TensorFlow and the model, not Keras (nor matplotlib through it); and
TensorFlow's compute threads at a lower priority than the threads that read and answer requests."""
import base64
import os

import requests

from server_harness import jpeg, worker_pid


def loaded_libraries(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_a_worker_serves_without_keras(tiny_server):
    maps = loaded_libraries(worker_pid(tiny_server.proc.pid))
    assert "_pywrap_tensorflow_internal" in maps, "the worker has not loaded TensorFlow at all"
    # Keras's own dependency optree ships a C extension that only an import of Keras loads; TensorFlow does not.
    assert "optree/_C" not in maps, "Keras was imported in the serving worker"
    assert "matplotlib" not in maps


def threads_of(pid: int) -> list[dict]:
    """Each thread's name, nice value and CPU ticks (proc(5): fields 14-15 are utime and stime, 19 is nice)."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            name = f.read().strip()
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        found.append({"tid": int(tid), "name": name, "nice": int(fields[16]),
                      "ticks": int(fields[11]) + int(fields[12])})
    return found


def test_the_model_runs_on_threads_niced_below_the_request_threads(tiny_server):
    body = {"instances": [{"b64": base64.b64encode(jpeg(seed=i)).decode()} for i in range(8)]}
    for _ in range(20):
        response = requests.post(f"{tiny_server.rest_url}/v1/models/flowers:predict", json=body, timeout=30)
        assert response.status_code == 200, response.text
    pid = worker_pid(tiny_server.proc.pid)
    threads = threads_of(pid)
    compute = [t for t in threads if t["name"] == "tf_Compute"]
    assert compute, f"no TensorFlow compute threads among {threads}"
    assert {t["nice"] for t in compute} == {10}, compute
    assert sum(t["ticks"] for t in compute) > 0, "the niced threads did none of the model's work"
    loop = next(t for t in threads if t["tid"] == pid)
    assert loop["nice"] == 0, "the worker's event loop (its main thread) was niced too"
    assert sum(t["nice"] == 0 for t in threads) >= 3, f"the batch threads were niced too: {threads}"
