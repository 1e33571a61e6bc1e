"""serving.client's checks of its own arguments, which need no server (the client against a real server is
tests/e2e/test_client.py)."""
from __future__ import annotations

import pytest

from serving.client import Client


def test_top_k_must_be_positive():
    with Client("127.0.0.1:1") as client, pytest.raises(ValueError):
        client.predict([b"x"], top_k=0)
