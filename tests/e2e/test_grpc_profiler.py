"""TensorFlow's profiler service on `petal serve`'s gRPC port, as TF Serving serves it (its guide "Profile Inference
Requests with TensorBoard", and tensorflow_model_server_test.py's test_profiler_service_with_valid_trace_request):
TensorFlow's own client, `tf.profiler.experimental.client.trace`, captures a trace of the inference requests that
run meanwhile, into files TensorBoard's profile plugin reads (read here with that plugin's own converter); and the
port's guarantees hold for it: tokens and roles, one trace at a time per worker, a bounded duration, a destination
that names one folder, the call's end ending the trace. On TF Serving's own half_plus_two (tests/data/tf_serving),
whose TF1 graph runs as a Session: its trace shows SessionRun and the graph's Mul and Add.
"""
from __future__ import annotations

import glob
import json
import os
import threading
import urllib.request
from concurrent import futures

import grpc
import pytest
import tensorflow as tf
from tensorflow.python.profiler.internal import _pywrap_profiler_plugin
from tensorflow.tsl.profiler.protobuf import profiler_options_pb2

from server_harness import run_server
from serving.protocols.grpc_api.profiler import ProfileRequest, ProfileResponse, TerminateRequest, TerminateResponse

MODEL = "--model_base_path=tests/data/tf_serving/saved_model_half_plus_two_cpu"
ADMIN_TOKEN, PREDICT_TOKEN = "profiler-admin-token-0123456789", "profiler-predict-token-0123456789"


def profile_stub(channel: grpc.Channel):
    return (channel.unary_unary("/tensorflow.ProfilerService/Profile",
                                request_serializer=ProfileRequest.SerializeToString,
                                response_deserializer=ProfileResponse.FromString),
            channel.unary_unary("/tensorflow.ProfilerService/Terminate",
                                request_serializer=TerminateRequest.SerializeToString,
                                response_deserializer=TerminateResponse.FromString))


def profile_request(root: str, duration_ms: int, session_id: str = "run1", emit_xspace: bool = False):
    return ProfileRequest(duration_ms=duration_ms, repository_root=root, session_id=session_id, host_name="petal",
                          emit_xspace=emit_xspace, opts=profiler_options_pb2.ProfileOptions(duration_ms=duration_ms))


def profile_when_free(profile, request, timeout: float = 30):
    """Profile, retried while the worker still ends an earlier trace (ALREADY_EXISTS): a trace that was stopped
    is still being collected and saved for a moment."""
    for _ in range(60):
        try:
            return profile(request, timeout=timeout)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
            threading.Event().wait(0.5)
    raise AssertionError("the worker's earlier trace never ended")


def trace_events(path: str) -> set[str]:
    """The names of the events TensorBoard's trace viewer shows for a saved trace."""
    data, converted = _pywrap_profiler_plugin.xspace_to_tools_data([path], "trace_viewer@", {})[:2]
    assert converted
    return {event.get("name") for event in json.loads(data)["traceEvents"]}


class Predicting:
    """REST predicts of half_plus_two, one after another, until stopped: the inference a trace should show."""

    def __init__(self, server) -> None:
        self.url, self.answers, self.stopped = f"{server.rest_url}/v1/models/default:predict", [], threading.Event()
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        while not self.stopped.is_set():
            request = urllib.request.Request(self.url, data=b'{"instances": [2.0, 3.0, 4.0]}',
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                self.answers.append(json.loads(response.read()))
            self.stopped.wait(0.05)

    def __enter__(self) -> Predicting:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stopped.set()
        self.thread.join()


@pytest.fixture(scope="module")
def open_server():
    with run_server(MODEL, "--model_name=default") as server:
        yield server


@pytest.fixture(scope="module")
def secured_server(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("profiler") / "tokens"
    tokens.write_text(f"{PREDICT_TOKEN}\n{ADMIN_TOKEN} admin\n")
    with run_server(MODEL, "--model_name=default", f"--auth_token_file={tokens}") as server:
        yield server


def test_tensorflows_client_captures_a_trace_of_the_inference_requests(open_server, tmp_path):
    logdir = str(tmp_path / "logs")
    with Predicting(open_server) as predicting:
        tf.profiler.experimental.client.trace(f"grpc://{open_server.grpc_target}", logdir, 2000,
                                              num_tracing_attempts=1)
    assert predicting.answers and predicting.answers[0] == {"predictions": [3.0, 3.5, 4.0]}
    traces = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1
    assert {"SessionRun", "Mul", "Add"} <= trace_events(traces[0])  # half_plus_two's graph, run by the requests


def test_a_trace_can_come_back_in_the_answer_and_is_saved_nowhere(open_server, tmp_path):
    profile, _ = profile_stub(grpc.insecure_channel(open_server.grpc_target))
    with Predicting(open_server):
        response = profile_when_free(profile, profile_request(str(tmp_path / "nowhere"), 1000, emit_xspace=True))
    assert not response.empty_trace and len(response.xspace) > 0
    assert not os.path.exists(tmp_path / "nowhere")


@pytest.mark.parametrize("duration_ms,session_id,words", [
    (0, "run1", "more than 0"), (120_000, "run1", "at most 60000 ms"), (1000, "../elsewhere", "session_id"),
    (1000, "", "session_id")])
def test_a_bad_request_is_refused_at_once_as_invalid_argument(open_server, tmp_path, duration_ms, session_id, words):
    profile, _ = profile_stub(grpc.insecure_channel(open_server.grpc_target))
    with pytest.raises(grpc.RpcError) as refused:
        profile(profile_request(str(tmp_path), duration_ms, session_id), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in refused.value.details()
    assert os.listdir(tmp_path) == []


def test_one_trace_at_a_time_the_second_refused_and_terminate_ends_the_first(open_server, tmp_path):
    channel = grpc.insecure_channel(open_server.grpc_target)
    profile, terminate = profile_stub(channel)
    with futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(profile_when_free, profile, profile_request(str(tmp_path), 50_000, "long"), 120)
        while True:  # until the first trace runs; a probe that runs first ends at its deadline and lets it
            try:
                profile(profile_request(str(tmp_path), 50_000, "second"), timeout=0.3)
            except grpc.RpcError as refused:
                if refused.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue
                assert refused.code() == grpc.StatusCode.ALREADY_EXISTS, refused.details()
                assert "already running" in refused.details()
                break
        for _ in range(30):  # the first may still wait for an earlier test's trace to end: until it is terminated
            terminate(TerminateRequest(session_id="long"), timeout=30)
            if futures.wait([first], timeout=1).done:
                break
        assert isinstance(first.result(timeout=0), ProfileResponse)  # ended by Terminate, long before its 50 s
    assert os.path.exists(tmp_path / "long" / "petal.xplane.pb")
    assert not os.path.exists(tmp_path / "second")


def test_a_call_past_its_deadline_ends_its_trace_and_frees_the_worker_for_the_next(open_server, tmp_path):
    profile, _ = profile_stub(grpc.insecure_channel(open_server.grpc_target))
    profile_when_free(profile, profile_request(str(tmp_path / "before"), 100))  # no earlier test's trace is left
    with pytest.raises(grpc.RpcError) as late:
        profile(profile_request(str(tmp_path), 30_000, "late"), timeout=1)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    response = profile_when_free(profile, profile_request(str(tmp_path), 500, "next"))
    assert isinstance(response, ProfileResponse)
    assert os.path.exists(tmp_path / "next" / "petal.xplane.pb") and not os.path.exists(tmp_path / "late")


@pytest.mark.parametrize("token,code", [(None, grpc.StatusCode.UNAUTHENTICATED),
                                        ("not-a-token", grpc.StatusCode.UNAUTHENTICATED),
                                        (PREDICT_TOKEN, grpc.StatusCode.PERMISSION_DENIED)])
def test_with_tokens_a_trace_needs_the_admin_role(secured_server, tmp_path, token, code):
    profile, terminate = profile_stub(grpc.insecure_channel(secured_server.grpc_target))
    metadata = [("authorization", f"Bearer {token}")] if token else None
    for call, request in ((profile, profile_request(str(tmp_path), 1000)), (terminate, TerminateRequest())):
        with pytest.raises(grpc.RpcError) as refused:
            call(request, timeout=30, metadata=metadata)
        assert refused.value.code() == code
    assert os.listdir(tmp_path) == []


def test_with_tokens_an_admin_token_traces(secured_server, tmp_path):
    profile, _ = profile_stub(grpc.insecure_channel(secured_server.grpc_target))
    response = profile(profile_request(str(tmp_path), 500), timeout=30,
                       metadata=[("authorization", f"Bearer {ADMIN_TOKEN}")])
    assert isinstance(response, ProfileResponse)
    assert os.path.exists(tmp_path / "run1" / "petal.xplane.pb")


def test_enable_profiler_false_serves_no_profiler(tmp_path):
    with run_server(MODEL, "--model_name=default", "--enable_profiler=false") as server:
        profile, _ = profile_stub(grpc.insecure_channel(server.grpc_target))
        with pytest.raises(grpc.RpcError) as refused:
            profile(profile_request(str(tmp_path), 500), timeout=30)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
