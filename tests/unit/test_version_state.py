"""Version states on the wire: each is TF Serving's ModelVersionStatus.State over gRPC and its name over REST."""
from types import SimpleNamespace

import pytest
from tensorflow_serving.apis import get_model_status_pb2

from serving.core import VersionState, VersionStatus
from serving.protocols.codec import strict_json, tfserving_json
from serving.protocols.grpc_api.tfserving import ModelService

State = get_model_status_pb2.ModelVersionStatus.State


def test_the_states_are_tf_servings_but_unknown():
    assert [s.value for s in VersionState] == [name for name in State.keys() if name != "UNKNOWN"]


# ModelVersionStatus.State's numbers in TF Serving's get_model_status.proto
PROTO_NUMBERS = {"START": 10, "LOADING": 20, "AVAILABLE": 30, "UNLOADING": 40, "END": 50}


class _Aborted(Exception):
    pass


class _Context:
    def abort(self, code, details):
        raise _Aborted(code, details)


@pytest.mark.parametrize("state", list(VersionState))
def test_grpc_get_model_status_sends_each_state_as_tf_servings_number(state):
    """Through the servicer: what a version's state becomes on the wire."""
    dataplane = SimpleNamespace(status=lambda model, version, label: [VersionStatus(3, state)],
                                reload_config=None)
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = "m"
    response = ModelService(dataplane).GetModelStatus(request, _Context())
    [entry] = response.model_version_status
    assert (entry.version, entry.state, entry.status.error_code) == (3, PROTO_NUMBERS[state.name], 0)


@pytest.mark.parametrize("state", list(VersionState))
def test_rest_status_json_names_the_state(state):
    body = strict_json.encode(tfserving_json.status_response([VersionStatus(3, state)])).decode()
    assert body == (f'{{"model_version_status":[{{"version":"3","state":"{state.name}",'
                    '"status":{"error_code":"OK","error_message":""}}]}')
