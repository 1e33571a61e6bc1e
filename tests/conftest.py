"""Shared test setup: quiet TensorFlow, the tests folder importable, and fixtures several test modules use."""
import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

from training_data import write_tfrecords  # noqa: E402


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """Real JPEGs of the five classes as train/eval shards plus labels.txt, shared by the training tests."""
    return write_tfrecords(str(tmp_path_factory.mktemp("tiny_flowers")))
