"""A worker's memory budget (serving/core/budget.py): its two shares, how the flags resolve it, and how an HTTP
request holds it from before its body is read until it is answered (serving/protocols/rest/admission.py), over a real
DataPlane on the tiny model through Flask's test client. tests/e2e/test_pixel_flood.py floods a real server."""
from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import threading
import time

import prometheus_client
import pytest

from exported_models.model_format import SCALED_JPEG_FILE
from server_harness import IMAGE_SIZE, b64, jpeg, tiny_model_base
from serving.core import Code, DataPlane, ServingError
from serving.core.budget import MemoryBudget
from serving.host.memory import MiB
from serving.memory_costs import BODY_BYTES_FACTOR, BYTES_PER_PIXEL, JSON_VALUE_BYTES
from serving.metrics import Metrics
from serving.options.config import DataPlaneOptions, ProtocolOptions, ServerOptions, model_config_for
from serving.process.flags import parse_args
from serving.process.memory_budget import resolve_memory_budget
from serving.protocols.codec.tensor_proto import STRING_ELEMENT_BYTES
from serving.protocols.codec.v2_bytes import frame
from serving.protocols.rest import admission
from serving.protocols.rest.app import create_app
from training.synth import render

PREDICT = "/v1/models/flowers:predict"
BUDGET = 8 * MiB
PIXELS = 1_000_000  # 4 MB kept for decoding, 4 MB for bodies


# --- the budget itself ------------------------------------------------------------------------------------------

def test_bodies_are_admitted_or_refused_at_once_and_given_back():
    budget = MemoryBudget(1000, 100)  # 400 bytes of pixels, 600 of bodies
    assert budget.body_limit == 600
    first = budget.hold(500)
    with pytest.raises(ServingError) as full:
        budget.hold(200)
    assert full.value.code == Code.UNAVAILABLE and "--memory_budget_bytes" in full.value.message
    with pytest.raises(ServingError) as never:
        budget.hold(601)
    assert never.value.code == Code.RESOURCE_EXHAUSTED
    with pytest.raises(ServingError):
        first.grow(101)  # a growing request is refused the same way, keeping what it held
    assert budget.held == 500
    first.release()
    with budget.hold(200) as second:
        second.grow(400)
        assert budget.held == 600
    assert budget.held == 0


def test_pixels_wait_in_their_own_share_which_bodies_never_take():
    budget = MemoryBudget(1000, 100)
    hold = budget.hold(600)  # bodies full: decoding still has its share, so an admitted request always finishes
    assert budget.acquire(100, deadline=time.monotonic() + 0.1)
    assert not budget.acquire(1, deadline=time.monotonic() + 0.1)
    threading.Timer(0.1, budget.release, args=(100,)).start()
    assert budget.acquire(60, deadline=time.monotonic() + 5)
    assert budget.held == 600 + 60 * BYTES_PER_PIXEL
    budget.release(60)
    hold.release()
    assert budget.held == 0
    with pytest.raises(ValueError):
        MemoryBudget(400, 100)  # nothing left for bodies
    off = MemoryBudget(-1, -1)
    assert off.acquire(10 ** 12) and off.hold(10 ** 12).nbytes == 10 ** 12 and off.held == 0


def test_each_body_refused_is_counted_by_reason():
    """They were counted nowhere: the 503s and 413s of a full budget were in no metric."""
    metrics = Metrics()
    budget = MemoryBudget(1000, 100, metrics)
    hold = budget.hold(500)
    for nbytes in (200, 200, 601):
        with pytest.raises(ServingError):
            budget.hold(nbytes)
    with pytest.raises(ServingError):
        hold.grow(101)  # to 601 in all: more than there ever is
    assert {reason: metrics.rejected.value(model_name="", reason=reason)
            for reason in ("memory_budget", "too_large_for_memory_budget")} == {
        "memory_budget": 2, "too_large_for_memory_budget": 2}
    pending = MemoryBudget(1000, 100, metrics, pending=True)
    with pytest.raises(ServingError):
        pending.hold(1)
    assert metrics.rejected.value(model_name="", reason="memory_budget") == 3


def test_what_is_held_is_exported_by_kind_as_it_changes():
    metrics = Metrics()
    budget = MemoryBudget(1000, 100, metrics)
    held = lambda: {kind: metrics.memory_held.value(kind=kind) for kind in ("bodies", "pixels")}  # noqa: E731
    hold = budget.hold(300)
    assert held() == {"bodies": 300, "pixels": 0}
    budget.acquire(50)
    hold.grow(100)
    assert held() == {"bodies": 400, "pixels": 50 * BYTES_PER_PIXEL}
    budget.release(50)
    hold.release()
    assert held() == {"bodies": 0, "pixels": 0}


# --- the flags ----------------------------------------------------------------------------------------------

def test_flags_derive_the_budget_and_its_pixel_share_and_keep_the_old_flag(capsys):
    derived = parse_args([])
    assert derived.dataplane.memory_budget_bytes == 0, "the options keep what was asked for: derive it"
    budget, pixels = resolve_memory_budget(derived)
    assert budget > 0 and pixels == max(budget // 2 // BYTES_PER_PIXEL, derived.dataplane.max_image_pixels)
    given = parse_args([f"--memory_budget_bytes={256 * MiB}", "--max_image_pixels=36000000"])
    assert resolve_memory_budget(given) == (256 * MiB, 36_000_000)
    old = parse_args(["--max_inflight_pixels=50000000"])  # the old flag sets the pixel share
    budget, pixels = resolve_memory_budget(old)
    assert pixels == 50_000_000 and budget > 50_000_000 * BYTES_PER_PIXEL
    for off in (["--max_inflight_pixels=-1"], ["--memory_budget_bytes=-1"]):
        assert resolve_memory_budget(parse_args(off)) == (-1, -1)
    with pytest.raises(ValueError, match="leave room for request bodies"):
        resolve_memory_budget(ServerOptions(DataPlaneOptions(memory_budget_bytes=100 * MiB,
                                                             max_inflight_pixels=40_000_000)))
    with pytest.raises(SystemExit) as exit_info:  # and parse_args refuses them at start
        parse_args([f"--memory_budget_bytes={100 * MiB}", "--max_inflight_pixels=40000000"])
    assert exit_info.value.code == 2 and "to leave room for request bodies" in capsys.readouterr().err


# --- measured once the models have loaded -------------------------------------------------------------------------

def test_a_pending_budget_admits_no_body_until_it_is_settled():
    metrics = Metrics()
    budget = MemoryBudget(1000, 100, metrics, pending=True)
    with pytest.raises(ServingError) as pending:
        budget.hold(1)
    assert pending.value.code == Code.UNAVAILABLE and "once its models have loaded" in pending.value.message
    assert "memory_budget_bytes{" not in exported(metrics), "no limit is shown before it is known"
    budget.settle(2000, 200)
    assert (budget.limit, budget.pixel_limit, budget.body_limit) == (2000, 200, 1200)
    with budget.hold(1200):
        assert budget.held == 1200
    assert ':petal:serving:memory_budget_bytes{kind="bodies"} 1200.0' in exported(metrics)
    assert ':petal:serving:memory_budget_bytes{kind="pixels"} 800.0' in exported(metrics)


def exported(metrics: Metrics) -> str:
    return prometheus_client.generate_latest(metrics.registry).decode()


@pytest.mark.parametrize("measured", [(64 * MiB, 4_000_000), None])
def test_the_core_settles_its_budget_after_the_load_and_before_it_starts(measured):
    """None: the measurement fails, and the estimate it started with stands rather than a budget that refuses all."""
    order: list[str] = []

    def measure() -> tuple[int, int]:  # noted, not asserted here: the DataPlane keeps its estimate on any error
        order.append("loaded" if dataplane.repository.ready() else "loading")
        order.append("gate open" if dataplane.startup.done else "gate shut")
        if measured is None:
            raise OSError("no cgroup files")
        return measured

    options = DataPlaneOptions(model_config_for("flowers", tiny_model_base()), file_system_poll_wait_seconds=0,
                               memory_budget_bytes=BUDGET, max_inflight_pixels=PIXELS)
    dataplane = DataPlane.create(options, budget_after_load=measure)
    try:
        assert dataplane.wait_started(time.monotonic() + 60)
        dataplane.wait_loaded()  # a second caller does not measure again
        assert order == ["loaded", "gate shut"], "the gate opens only once the budget is known"
        assert (dataplane.memory.limit, dataplane.memory.pixel_limit) == (measured or (BUDGET, PIXELS))
        dataplane.memory.hold(1).release()
    finally:
        dataplane.close()


# --- over HTTP ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dataplane(make_dataplane):
    return make_dataplane(model_base_path=tiny_model_base(), memory_budget_bytes=BUDGET, max_inflight_pixels=PIXELS,
                     max_image_pixels=PIXELS)


@pytest.fixture(scope="module")
def client(dataplane):
    return create_app(dataplane, ProtocolOptions(rest_api_timeout_in_ms=10_000)).test_client()


def predict_body(images: int = 1, padding: int = 0) -> bytes:
    """A predict of small JPEGs, padded with JSON whitespace to a given size."""
    return json.dumps({"instances": [b64(jpeg(seed=i)) for i in range(images)]}).encode() + b" " * padding


def refused(response, status: int) -> str:
    assert response.status_code == status, response.get_data(as_text=True)
    body = response.get_json()
    assert set(body) == {"error"}
    return body["error"]


def test_a_request_holds_its_body_until_answered_then_gives_it_back(client, dataplane):
    seen = []
    held = dataplane.memory.hold(0)
    try:
        original = dataplane.predict

        def spy(*args, **kwargs):
            seen.append(dataplane.memory.held)
            return original(*args, **kwargs)
        dataplane.predict = spy
        body = predict_body(padding=100_000)
        assert client.post(PREDICT, data=body, content_type="application/json").status_code == 200
    finally:
        del dataplane.predict
        held.release()
    # the body before it was read, then its one value outside strings, held while it ran
    assert seen == [len(body) * BODY_BYTES_FACTOR + JSON_VALUE_BYTES]
    assert dataplane.memory.held == 0


@pytest.mark.parametrize("chunked", [False, True], ids=["content_length", "chunked"])
def test_a_body_is_charged_as_it_arrives_and_the_first_piece_past_the_budget_is_503(client, dataplane, chunked):
    """A declared Content-Length is a claim, not a charge: charged up front, bodies declared and never sent held the
    budget (tests/e2e/test_front_end_floods.py). Declared or chunked, a body is refused at its first piece that
    does not fit."""
    body = predict_body(padding=MiB)
    framing = {"headers": {"Transfer-Encoding": "chunked"}, "environ_overrides": {"wsgi.input_terminated": True}} \
        if chunked else {"content_length": len(body)}
    with dataplane.memory.hold(dataplane.memory.body_limit - MiB):
        stream = io.BytesIO(body)
        response = client.post(PREDICT, input_stream=stream, content_type="application/json", **framing)
        assert "memory budget" in refused(response, 503) and response.headers["Retry-After"] == "1"
        assert 0 < stream.tell() < len(body), "refused part way, at the first piece that did not fit"
    response = client.post(PREDICT, input_stream=io.BytesIO(body), content_type="application/json", **framing)
    assert response.status_code == 200, response.get_data(as_text=True)
    assert dataplane.memory.held == 0


@pytest.mark.parametrize("scaled", [True, False], ids=["as exported", "without the export's record"])
def test_a_jpeg_holds_the_pixels_its_signature_decodes(make_dataplane, tmp_path, monkeypatch, scaled):
    """The tiny model's signature decodes a 1024x768 JPEG at 1/8 (128x96 still covers 32x32), and one of 32x32 in
    full, as its export records; a copy without that record is charged in full, as any other model is. (Without
    the batch cost's measure, whose charge for a row's activations joins these: tests/unit/test_batch_cost.py.)"""
    base = tmp_path / "flowers"
    shutil.copytree(tiny_model_base(), base)
    if not scaled:
        os.remove(base / "1" / SCALED_JPEG_FILE)
    dataplane = make_dataplane(model_base_path=str(base), memory_budget_bytes=BUDGET, batch_cost_seconds=0)
    charged = []
    run = dataplane.batcher.run
    monkeypatch.setattr(dataplane.batcher, "run", lambda request: charged.append(request.row_pixels.tolist()) or run(
        request))
    body = {"instances": [b64(render("daisy", 1, size=(1024, 768))), b64(jpeg(seed=1))]}
    response = create_app(dataplane, ProtocolOptions()).test_client().post(PREDICT, json=body)
    assert response.status_code == 200, response.get_data(as_text=True)
    assert charged == [[128 * 96 if scaled else 1024 * 768, IMAGE_SIZE * IMAGE_SIZE]]


def test_more_than_the_budget_could_ever_hold_is_413(client, dataplane):
    too_big = predict_body(padding=dataplane.memory.body_limit // BODY_BYTES_FACTOR)
    assert "memory budget" in refused(client.post(PREDICT, data=too_big, content_type="application/json"), 413)
    inflated = gzip.compress(too_big)  # small on the wire, charged as it inflates
    response = client.post(PREDICT, data=inflated, content_type="application/json",
                           headers={"Content-Encoding": "gzip"})
    assert "memory budget" in refused(response, 413)
    numbers = json.dumps({"instances": [[0.5] * 1000] * 100}).encode()  # 0.5 MB of JSON, 6.4 MB parsed
    assert "memory budget" in refused(client.post(PREDICT, data=numbers, content_type="application/json"), 413)
    assert dataplane.memory.held == 0


def test_errors_and_multipart_give_the_budget_back(client, dataplane):
    assert client.post(PREDICT, data=b"{not json", content_type="application/json").status_code == 400
    response = client.post("/v1/models/flowers:classify_image", content_type="multipart/form-data",
                           data={"image": (io.BytesIO(jpeg()), "a.jpg")})
    assert response.status_code == 200, response.get_data(as_text=True)
    assert client.post("/v1/models/nope:predict", data=predict_body(), content_type="application/json"
                       ).status_code == 404
    assert dataplane.memory.held == 0


def test_v2_binary_bytes_are_charged_for_the_objects_they_decode_to_before_they_are_decoded(client, dataplane):
    """Two-byte BYTES elements are 6 bytes on the wire and about 40 decoded: the hold grows by the objects before
    the body is split into them, so a body well inside the budget that would decode past it is a 413."""
    count = dataplane.memory.body_limit // STRING_ELEMENT_BYTES + 1
    raw = frame([b"ab"] * count)
    assert len(raw) * BODY_BYTES_FACTOR < dataplane.memory.body_limit, "the body alone fits"
    header = json.dumps({"inputs": [{"name": "image_bytes", "shape": [count], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(raw)}}]}).encode()
    response = client.post("/v2/models/flowers/infer", data=header + raw,
                           headers={"Inference-Header-Content-Length": str(len(header))},
                           content_type="application/octet-stream")
    assert "memory budget" in refused(response, 413)
    assert dataplane.memory.held == 0


def test_examples_are_charged_for_the_context_copied_into_each_before_it_is_copied(client, dataplane, monkeypatch):
    """A classify of one context and many empty examples is small on the wire, but every example is served with the
    context's bytes before its own (as TF Serving feeds them): 64 KB of context and 100 examples are a 90 KB body
    and 13 MB of examples, past this budget, refused before they are built. Fewer fit, held while the call runs."""
    context = {"image_bytes": b64(bytes(64 * 1024))}
    body = json.dumps({"context": context, "examples": [{}] * 100}).encode()
    assert len(body) * BODY_BYTES_FACTOR < dataplane.memory.body_limit, "the body alone fits"
    response = client.post("/v1/models/flowers:classify", data=body, content_type="application/json")
    assert "memory budget" in refused(response, 429)  # RESOURCE_EXHAUSTED, in TF Serving's table of statuses
    assert dataplane.memory.held == 0

    seen = []
    acquire = dataplane.memory.acquire

    def spy(pixels: int, deadline: float | None = None) -> bool:
        seen.append(dataplane.memory.held)  # what the request holds as its model call waits for its pixels
        return acquire(pixels, deadline)
    monkeypatch.setattr(dataplane.memory, "acquire", spy)
    small = json.dumps({"context": {"image_bytes": b64(jpeg())}, "examples": [{}] * 3}).encode()
    response = client.post("/v1/models/flowers:classify", data=small, content_type="application/json")
    assert response.status_code == 200, response.get_data(as_text=True)
    assert len(response.get_json()["results"]) == 3
    assert seen and seen[0] > len(small) * BODY_BYTES_FACTOR + 3 * 2 * len(jpeg()), "the examples held as they run"
    assert dataplane.memory.held == 0


def test_an_answer_is_held_until_it_is_written_then_given_back(client, dataplane, monkeypatch):
    """The request's hold ends as the view returns, before a byte is written: a client that does not read kept a
    large answer outside the budget (30 of 8 MB answers, +224 MiB)."""
    monkeypatch.setattr(admission, "ANSWER_HELD_BYTES", 100)  # the tiny model's answers are a few hundred bytes
    response = client.post(PREDICT, data=predict_body(images=2), content_type="application/json", buffered=False)
    assert response.status_code == 200 and response.content_length >= 100
    assert dataplane.memory.held == response.content_length, "held while it is being written"
    response.close()
    assert dataplane.memory.held == 0


def test_an_answer_the_budget_has_no_room_for_is_503(client, dataplane, monkeypatch):
    monkeypatch.setattr(admission, "ANSWER_HELD_BYTES", 100)
    body = predict_body(images=2)
    first = client.post(PREDICT, data=body, content_type="application/json", buffered=True)
    answer = first.content_length
    # room for the request (its body, its one value outside strings, a few bytes more) but not for its answer
    hog = dataplane.memory.hold(dataplane.memory.body_limit - len(body) * BODY_BYTES_FACTOR - JSON_VALUE_BYTES
                                - answer // 2)
    try:
        response = client.post(PREDICT, data=body, content_type="application/json")
        message = refused(response, 503)
        response.close()
    finally:
        hog.release()
    assert message.startswith("The answer (") and "memory budget" in message
    assert dataplane.memory.held == 0
