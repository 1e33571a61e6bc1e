"""Fixtures several end-to-end modules share: one `petal serve` on the tiny model, the tiny training data, a gRPC
channel and PredictionService stub to the module's own `server`, and one standalone Spark cluster per test process."""
import pytest

from server_harness import run_server, tiny_model_base
from training_data import write_tfrecords


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """Real JPEGs of the five classes as train/eval shards plus labels.txt, shared by the training tests."""
    return write_tfrecords(str(tmp_path_factory.mktemp("tiny_flowers")))


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory):
    """The Spark tests' standalone cluster (tests/spark_cluster.py), started at most once in a test process."""
    from spark_cluster import running_cluster

    with running_cluster(tmp_path_factory.mktemp("spark-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def tiny_server():
    """`petal serve` on the tiny test model, for the modules that only read from it (client, KServe V2)."""
    with run_server(f"--model_base_path={tiny_model_base()}", "--model_name=flowers") as server:
        yield server


@pytest.fixture(scope="module")
def channel(server):
    """A gRPC channel to the module's `server` that carries messages of images (tests/grpc_calls.py)."""
    import grpc

    from grpc_calls import CHANNEL_OPTIONS

    with grpc.insecure_channel(server.grpc_target, options=CHANNEL_OPTIONS) as opened:
        yield opened


@pytest.fixture(scope="module")
def stub(channel):
    """TF Serving's PredictionService on the module's `server`, as its example clients make it."""
    from tensorflow_serving.apis import prediction_service_pb2_grpc

    return prediction_service_pb2_grpc.PredictionServiceStub(channel)
