"""Fixtures several end-to-end modules share: one `petal serve` on the tiny model, and the tiny training data."""
import pytest

from server_harness import run_server, tiny_model_base
from training_data import write_tfrecords


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """Real JPEGs of the five classes as train/eval shards plus labels.txt, shared by the training tests."""
    return write_tfrecords(str(tmp_path_factory.mktemp("tiny_flowers")))


@pytest.fixture(scope="session")
def tiny_server():
    """`petal serve` on the tiny test model, for the modules that only read from it (client, KServe V2)."""
    with run_server(f"--model_base_path={tiny_model_base()}", "--model_name=flowers") as server:
        yield server
