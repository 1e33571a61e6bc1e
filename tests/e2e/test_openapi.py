"""Schemathesis fuzzes a real `petal serve` (gunicorn, the tiny model) against the OpenAPI contract it serves at
/openapi.json, in all four of its phases: examples, coverage and fuzzing (positive and negative cases for every
operation), then stateful (sequences of calls, each taking values from an earlier answer through the links
schemathesis infers from the contract: an infer's answer names the model and version of the next). Every answer
must not be a 5xx, and its status code, content type, headers and body must be the ones the contract documents for
that operation. The stateful phase found issue 30's 500: a V2 infer whose input's "datatype" is an object.

The contract's examples (a real JPEG in each body, the model "flowers", version 1, label "stable") let cases
reach a 200: the examples phase sends them as they are, and two hooks give half the fuzzed cases the served names
and half the fuzzed JSON bodies real tensors, so generated parameters and outputs meet a real prediction. The
image/* and octet-stream bodies are drawn from real JPEGs, truncated ones and noise, so both the happy path and
the image decoder's errors are exercised. Bounded (about half a minute on two cores): a fixed seed, derandomized,
max_examples per operation and phase, no shrinking, no example database, a per-request timeout; the stateful phase
a fixed number of scenarios of a few steps each (about half a minute more).
tests/inprocess/test_http_inprocess.py checks that the served contract and the URL rules agree.
"""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from server_harness import jpeg, run_server, tiny_model_base
from serving.options.config import DEFAULT_METRICS_PATH
from serving.protocols.codec.v2_bytes import frame
from serving.protocols.rest import openapi

MAX_EXAMPLES = 30
STATEFUL_SCENARIOS = 40
STATEFUL_STEPS = 6
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
CONFIG = {
    "seed": 14,
    "request-timeout": 30,
    "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "deterministic": True, "no-shrink": True,
                   "database": "none"},
    # The coverage phase would also send methods no operation has: /v1 answers those 400 "Malformed request",
    # as TF Serving does, which the contract states in its description, not per operation.
    "phases": {"coverage": {"unexpected-methods": []}},
}

_JPEGS = [jpeg(size=size, seed=seed) for size, seed in ((32, 0), (17, 1), (48, 2))]
IMAGES = st.one_of(st.sampled_from(_JPEGS), st.sampled_from(_JPEGS).map(lambda data: data[:len(data) // 2]),
                   st.binary(max_size=64))
schemathesis.openapi.media_type("image/*", IMAGES, aliases=["image/jpeg", "image/png"])


def triton_binary_request(image: bytes) -> bytes:
    """A V2 request in Triton's binary form without its header-length header: the server must refuse it as JSON
    that does not parse (a 400), whatever the bytes; the full binary path is covered in-process."""
    return frame([image])


schemathesis.openapi.media_type("application/octet-stream", IMAGES | IMAGES.map(triton_binary_request))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The tiny model as "flowers" version 1, labelled "stable" so the /labels/ operations can succeed."""
    config = tmp_path_factory.mktemp("openapi") / "models.config"
    config.write_text(f'model_config_list {{ config {{ name: "flowers" base_path: "{tiny_model_base()}" '
                      'model_platform: "tensorflow" version_labels { key: "stable" value: 1 } } }')
    # labels at start name versions not loaded yet: TF Serving needs the flag too
    with run_server(f"--model_config_file={config}", "--allow_version_labels_for_unavailable_models=true",
                    "--port=0") as server:
        yield server


# The contract as a server with the default metrics path serves it (test_http_inprocess.py checks the served copy
# equals this). Loaded at import, not through schemathesis.pytest.from_fixture, whose lazy loader sets pytest's
# private Function._nodeid, which pytest 9 no longer has; the base URL is given at call time instead.
contract = schemathesis.openapi.from_dict(openapi.contract(DEFAULT_METRICS_PATH),
                                          config=schemathesis.Config.from_dict(CONFIG))

# The contract's own valid examples, by the operation path's ending, and the body fields they hold the tensors in.
_REAL_TENSORS = {":predict": "Predict", ":classify": "Classify", "/infer": "Infer"}
_TENSOR_FIELDS = ("instances", "inputs", "examples")


@contract.hook
def flatmap_body(context, body):
    """Half the JSON bodies of predict, classify and infer get the contract example's tensors in place of theirs:
    random tensors stop at the first 400, so without this the generated parameters, outputs and signature names
    would never reach a real prediction and the code that reads them after one."""
    ending = next((e for e in _REAL_TENSORS if context.operation.path.endswith(e)), None)
    if ending is None or not isinstance(body, dict):
        return st.just(body)
    example = contract.raw_schema["components"]["requestBodies"][_REAL_TENSORS[ending]]["content"][
        "application/json"]["example"]
    real = {**{k: v for k, v in body.items() if k not in _TENSOR_FIELDS}, **example}
    return st.sampled_from([body, real])



@contract.hook
def flatmap_path_parameters(context, path_parameters):
    """Half the cases name the served model, version and label (the contract's examples): random names only ever
    reach the 404 of an unknown model."""
    served = {p["name"]: p["schema"]["examples"][0] for p in contract.raw_schema["components"]["parameters"].values()
              if p["in"] == "path"}
    if not isinstance(path_parameters, dict):
        return st.just(path_parameters)
    return st.sampled_from([path_parameters, {**path_parameters, **{k: served[k] for k in path_parameters}}])


@contract.parametrize()
def test_every_operation_keeps_the_contract(case, server):
    case.call_and_validate(base_url=server.rest_url, checks=CHECKS)


def test_stateful_call_sequences_keep_the_contract(server):
    """The stateful phase: schemathesis' state machine over the contract, each scenario a few linked calls."""
    class Workflow(contract.as_state_machine()):  # type: ignore[misc]
        def get_call_kwargs(self, case):
            return {"base_url": server.rest_url}

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            case.validate_response(response, checks=CHECKS, transport_kwargs=kwargs)

    Workflow.run(settings=settings(max_examples=STATEFUL_SCENARIOS, stateful_step_count=STATEFUL_STEPS,
                                   deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                                   suppress_health_check=list(HealthCheck)))
