"""Shared test setup: quiet TensorFlow, the tests folder importable, and fixtures several test modules use."""
import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

from server_harness import run_server, tiny_model_base  # noqa: E402
from training_data import write_tfrecords  # noqa: E402


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The container build first, then the other slow tests, each group in pytest-randomly's order: under
    pytest-xdist the longest work then starts at once beside everything else instead of ending the run alone."""
    items.sort(key=lambda item: (item.get_closest_marker("container") is None,
                                 item.get_closest_marker("slow") is None))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """Real JPEGs of the five classes as train/eval shards plus labels.txt, shared by the training tests."""
    return write_tfrecords(str(tmp_path_factory.mktemp("tiny_flowers")))


@pytest.fixture(scope="session")
def tiny_server():
    """`petal serve` on the tiny test model, for the modules that only read from it (client, KServe V2)."""
    with run_server(f"--model_base_path={tiny_model_base()}", "--model_name=flowers") as server:
        yield server
