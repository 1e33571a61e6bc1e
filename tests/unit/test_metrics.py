"""Petal's metrics: TF Serving's exposition, in-process isolation, and aggregation across worker processes."""
from __future__ import annotations

import multiprocessing
import os

import pytest

from serving import metrics as metrics_module
from serving.metrics import (
    BATCH_SIZE_BUCKETS,
    Metrics,
    Stage,
    prepare_multiprocess,
    worker_exited,
)

TFS = ":tensorflow:serving:"


def block(text: str, name: str) -> list[str]:
    """The lines of one metric family: its HELP and TYPE and every sample line of that name."""
    return [line for line in text.splitlines()
            if line.split(" ", 3)[2:3] == [name] or line.startswith((name + "{", name + " ", name + "_"))]


@pytest.fixture
def multiproc_dir(tmp_path):
    """A master's multiprocess setup, undone afterwards: later tests' `Metrics` get in-process values again."""
    assert metrics_module.MULTIPROC_ENV not in os.environ
    directory = str(tmp_path / "prometheus")
    prepare_multiprocess(directory)
    try:
        yield directory
    finally:
        os.environ.pop(metrics_module.MULTIPROC_ENV, None)


def test_counter_exposition_keeps_tf_serving_names():
    metrics = Metrics()
    metrics.request_count.inc(model_name="flowers", status="OK")
    metrics.request_count.inc(model_name="flowers", status="OK")
    metrics.request_count.inc(model_name="flowers", status="INVALID_ARGUMENT")
    metrics.warmup_requests.inc(200, model_name="flowers", version="1")
    text = metrics.render()
    assert block(text, TFS + "request_count") == [
        f"# HELP {TFS}request_count The total number of requests.",
        f"# TYPE {TFS}request_count counter",
        f'{TFS}request_count{{model_name="flowers",status="INVALID_ARGUMENT"}} 1',
        f'{TFS}request_count{{model_name="flowers",status="OK"}} 2',
    ]
    assert ':petal:serving:warmup_requests{model_name="flowers",version="1"} 200\n' in text
    assert "_total" not in text.replace(TFS + "request_example_count_total", "") and "_created" not in text
    assert metrics.request_count.value(model_name="flowers", status="OK") == 2
    assert metrics.request_count.value(model_name="flowers", status="NOT_FOUND") == 0


def test_a_counter_named_with_total_as_tf_serving_names_it_keeps_the_name():
    """TF Serving's request_example_count_total (servables/tensorflow/util.cc), which prometheus_client would
    collect as `request_example_count`; and request_example_counts' buckets, powers of 2 up to 16384."""
    metrics = Metrics()
    metrics.example_count_total.inc(3, model="m")
    metrics.example_counts.observe(3, model="m")
    text = metrics.render()
    assert block(text, TFS + "request_example_count_total") == [
        f"# HELP {TFS}request_example_count_total The total number of tensorflow.Examples.",
        f"# TYPE {TFS}request_example_count_total counter",
        f'{TFS}request_example_count_total{{model="m"}} 3',
    ]
    assert metrics.example_count_total.value(model="m") == 3
    buckets = [line for line in block(text, TFS + "request_example_counts") if "_bucket" in line]
    assert [line.split('le="')[1].split('"')[0] for line in buckets] == \
        [str(2 ** i) for i in range(15)] + ["+Inf"]
    assert [line.rsplit(" ", 1)[1] for line in buckets] == ["0", "0"] + ["1"] * 14


def test_histogram_exposition():
    metrics = Metrics()
    metrics.processed_batch_size.observe(3, model_name="m")
    metrics.processed_batch_size.observe(8, model_name="m")
    name = TFS + "batching_session:processed_batch_size"
    cumulative = {1: 0, 2: 0, 4: 1}
    buckets = [f'{name}_bucket{{model_name="m",le="{int(b)}"}} {cumulative.get(int(b), 2)}'
               for b in BATCH_SIZE_BUCKETS]
    assert block(metrics.render(), name) == [
        f"# HELP {name} Tracks the batch size distribution on processing.",
        f"# TYPE {name} histogram",
        *buckets,
        f'{name}_bucket{{model_name="m",le="+Inf"}} 2',
        f'{name}_sum{{model_name="m"}} 11',
        f'{name}_count{{model_name="m"}} 2',
    ]
    assert metrics.processed_batch_size.count(model_name="m") == 2
    metrics.request_latency.observe(15.0, model_name="m", API="predict", entrypoint="REST")
    text = metrics.render()
    assert f'{TFS}request_latency_bucket{{model_name="m",API="predict",entrypoint="REST",le="10"}} 0\n' in text
    assert f'{TFS}request_latency_bucket{{model_name="m",API="predict",entrypoint="REST",le="18"}} 1\n' in text
    assert f'{TFS}request_latency_count{{model_name="m",API="predict",entrypoint="REST"}} 1\n' in text


def test_gauge_exposition_and_remove():
    metrics = Metrics()
    metrics.queue_depth.inc(3, model_name="m")
    metrics.queue_depth.inc(-1, model_name="m")
    metrics.loaded_versions.set(1, model_name="m", version="1")
    metrics.loaded_versions.set(1, model_name="m", version="2")
    metrics.loaded_versions.remove(model_name="m", version="1")
    text = metrics.render()
    assert block(text, ":petal:serving:batch_queue_depth") == [
        "# HELP :petal:serving:batch_queue_depth Rows waiting in the batch queue.",
        "# TYPE :petal:serving:batch_queue_depth gauge",
        ':petal:serving:batch_queue_depth{model_name="m"} 2',
    ]
    assert block(text, ":petal:serving:loaded_versions") == [
        "# HELP :petal:serving:loaded_versions 1 for each AVAILABLE model version.",
        "# TYPE :petal:serving:loaded_versions gauge",
        ':petal:serving:loaded_versions{model_name="m",version="2"} 1',
    ]
    assert metrics.loaded_versions.value(model_name="m", version="1") == 0
    metrics.loaded_versions.set(1, model_name="m", version="1")  # reloaded after removal
    assert ':petal:serving:loaded_versions{model_name="m",version="1"} 1\n' in metrics.render()


def test_instances_are_isolated_in_process():
    first, second = Metrics(), Metrics()
    first.request_count.inc(model_name="a", status="OK")
    first.rejected.inc(model_name="a", reason="queue_full")
    second.request_count.inc(3, model_name="a", status="OK")
    assert first.request_count.value(model_name="a", status="OK") == 1
    assert second.request_count.value(model_name="a", status="OK") == 3
    assert second.rejected.value(model_name="a", reason="queue_full") == 0
    assert ':petal:serving:rejected_requests{' not in second.render()
    # Every family is declared, even with no samples yet.
    assert Metrics().render().count("# TYPE ") == 25


def test_version_statistics_add_up_each_versions_requests_and_executions():
    metrics = Metrics()
    metrics.record_request("m", 1, True, 100.0)
    metrics.record_request("m", 1, False, 40.0)
    metrics.record_request("m", 2, True, 7.0)
    metrics.record_execution("m", 1, [10.0, 30.0], rows=2, batch_size=4, elapsed_us=50.0)
    metrics.record_execution("m", 1, [5.0], rows=1, batch_size=1, elapsed_us=20.0)
    one, two = metrics.version_statistics()[("m", 1)], metrics.version_statistics()[("m", 2)]
    assert (one.success, one.fail) == (Stage(1, 100.0), Stage(1, 40.0))
    assert (one.queue, one.compute) == (Stage(3, 45.0), Stage(3, 120.0))  # each request's wait; its execution's time
    assert one.inference_count == 3 and one.batches == {4: Stage(1, 50.0), 1: Stage(1, 20.0)}
    assert (two.success, two.inference_count, two.batches) == (Stage(1, 7.0), 0, {})
    assert one.last_inference_ms > 0


def _worker(requests: int, queued: int, ready, done) -> None:
    metrics = Metrics()  # as a gunicorn worker does after the fork
    for _ in range(requests):
        metrics.request_count.inc(model_name="flowers", status="OK")
        metrics.request_latency.observe(15.0, model_name="flowers", API="predict", entrypoint="REST")
        metrics.example_count_total.inc(2, model="flowers")
    metrics.queue_depth.inc(queued, model_name="flowers")
    metrics.loaded_versions.set(1, model_name="flowers", version="1")
    ready.set()
    done.wait(60)


def _master(directory: str, texts) -> None:
    """A gunicorn master's part: prepare the directory, fork (here: spawn) two workers, render while they live,
    and forget each as it is reaped. It runs in a process of its own because pytest's process may still run other
    tests' threads (a DataPlane's loader), whose gauges would land in the directory under pytest's pid once this
    process's values were switched to it, and stay there after both workers are gone."""
    prepare_multiprocess(directory)
    # Spawned, not forked: a fork taken while another thread holds a lock (prometheus_client's included) hangs.
    context = multiprocessing.get_context("spawn")
    done = context.Event()
    workers = []
    for requests, queued in ((2, 3), (5, 4)):
        ready = context.Event()
        worker = context.Process(target=_worker, args=(requests, queued, ready, done))
        worker.start()
        assert ready.wait(60)
        workers.append(worker)
    try:
        rendered = [Metrics().render()]  # any worker renders the same aggregate
    finally:
        done.set()
        for worker in workers:
            worker.join(60)
    for worker in workers:
        worker_exited(worker.pid)
        rendered.append(Metrics().render())
    texts.put(([w.exitcode for w in workers], rendered))


def test_workers_aggregate_through_the_directory(tmp_path):
    context = multiprocessing.get_context("spawn")
    texts = context.Queue()
    master = context.Process(target=_master, args=(str(tmp_path / "prometheus"), texts))
    master.start()
    exitcodes, (text, one_gone, both_gone) = texts.get(timeout=180)
    master.join(60)
    assert master.exitcode == 0 and exitcodes == [0, 0]

    assert f'{TFS}request_count{{model_name="flowers",status="OK"}} 7\n' in text
    assert f'{TFS}request_latency_count{{model_name="flowers",API="predict",entrypoint="REST"}} 7\n' in text
    assert ':petal:serving:batch_queue_depth{model_name="flowers"} 7\n' in text  # livesum
    # livemax: two workers serving the same version still say 1, and only one series, with no pid label.
    assert block(text, ":petal:serving:loaded_versions")[2:] == [
        ':petal:serving:loaded_versions{model_name="flowers",version="1"} 1']
    assert f'{TFS}request_example_count_total{{model="flowers"}} 14\n' in text
    assert "_total" not in text.replace(TFS + "request_example_count_total", "") and "pid=" not in text

    assert ':petal:serving:batch_queue_depth{model_name="flowers"} 4\n' in one_gone  # the dead worker's 3 is gone
    assert f'{TFS}request_count{{model_name="flowers",status="OK"}} 7\n' in one_gone  # counters keep its requests
    assert ":petal:serving:batch_queue_depth{" not in both_gone
    assert ":petal:serving:loaded_versions{" not in both_gone


def test_remove_in_multiprocess_mode_hides_the_series(multiproc_dir):
    metrics = Metrics()
    metrics.loaded_versions.set(1, model_name="m", version="1")
    metrics.loaded_versions.set(1, model_name="m", version="2")
    metrics.loaded_versions.remove(model_name="m", version="1")
    text = metrics.render()
    assert ':petal:serving:loaded_versions{model_name="m",version="2"} 1\n' in text
    assert 'version="1"' not in text
    assert any(name.startswith("gauge_livemax_") for name in os.listdir(multiproc_dir))


def test_prepare_multiprocess_clears_old_files_and_in_process_mode_returns(multiproc_dir):
    stale = os.path.join(multiproc_dir, "counter_999999.db")
    keep = os.path.join(multiproc_dir, "README")
    for path in (stale, keep):
        open(path, "wb").close()
    prepare_multiprocess(multiproc_dir)
    assert os.listdir(multiproc_dir) == ["README"]
    worker_exited(999999)  # unknown pid: nothing to do

    os.environ.pop(metrics_module.MULTIPROC_ENV)
    metrics = Metrics()
    metrics.request_count.inc(model_name="m", status="OK")
    assert os.listdir(multiproc_dir) == ["README"]  # in-process values again
    worker_exited(1)  # a no-op without the directory
