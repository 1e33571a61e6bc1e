"""Shared test setup: quiet TensorFlow, and the repository root on the path for subprocesses."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
