"""The gRPC port's flags without a server: --grpc_channel_arguments parsed as TF Serving parses them, and bind
addresses with IPv6 literals bracketed (the gRPC API on a real `petal serve` is tests/e2e/test_grpc.py)."""
from __future__ import annotations

import pytest

from serving.options.config import bind_address
from serving.protocols.grpc_api.server import parse_channel_arguments


def test_channel_arguments_parse():
    assert parse_channel_arguments("grpc.max_connection_age_ms=2000, grpc.primary_user_agent=petal") == [
        ("grpc.max_connection_age_ms", 2000), ("grpc.primary_user_agent", "petal")]
    assert parse_channel_arguments("") == []
    with pytest.raises(ValueError):
        parse_channel_arguments("no_equals_sign")


def test_bind_address_brackets_ipv6_literals():
    assert bind_address("127.0.0.1", 8500) == "127.0.0.1:8500"
    assert bind_address("::", 8500) == "[::]:8500"
    assert bind_address("[::1]", 8501) == "[::1]:8501"
