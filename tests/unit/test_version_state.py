"""Version states on the wire: each is TF Serving's ModelVersionStatus.State over gRPC and its name over REST."""
import pytest
from tensorflow_serving.apis import get_model_status_pb2

from serving.core import VersionState, VersionStatus
from serving.protocols.codec import strict_json, tfserving_json

State = get_model_status_pb2.ModelVersionStatus.State


def test_the_states_are_tf_servings_but_unknown():
    assert [s.value for s in VersionState] == [name for name in State.keys() if name != "UNKNOWN"]


@pytest.mark.parametrize("state", list(VersionState))
def test_a_state_maps_to_the_proto_value_of_its_name(state):
    assert State.Value(state) == State.Value(state.name)
    assert State.Name(State.Value(state)) == state


@pytest.mark.parametrize("state", list(VersionState))
def test_rest_status_json_names_the_state(state):
    body = strict_json.encode(tfserving_json.status_response([VersionStatus(3, state)])).decode()
    assert body == (f'{{"model_version_status":[{{"version":"3","state":"{state.name}",'
                    '"status":{"error_code":"OK","error_message":""}}]}')
