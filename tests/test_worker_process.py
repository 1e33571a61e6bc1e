"""What a serving worker process loads: TensorFlow and the model, not Keras (nor matplotlib through it)."""
from server_harness import worker_pid


def loaded_libraries(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_a_worker_serves_without_keras(tiny_server):
    maps = loaded_libraries(worker_pid(tiny_server.proc.pid))
    assert "_pywrap_tensorflow_internal" in maps, "the worker has not loaded TensorFlow at all"
    # Keras's own dependency optree ships a C extension that only an import of Keras loads; TensorFlow does not.
    assert "optree/_C" not in maps, "Keras was imported in the serving worker"
    assert "matplotlib" not in maps
