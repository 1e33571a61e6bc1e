"""Shared test setup: quiet TensorFlow, the tests folder importable, each test's tier marker from its folder, and the
fixtures tests of every tier share."""
import builtins
import collections
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

HERE = Path(__file__).parent
# The tier of each test folder; tests/container/ (the image's smoke test) is end to end.
TIERS = {"unit": "unit", "inprocess": "inprocess", "e2e": "e2e", "container": "e2e"}


def tier(item: pytest.Item) -> str:
    """The tier the test's folder under tests/ names; a test file straight in tests/ has none, so it fails here."""
    folder = item.path.relative_to(HERE).parts[0]
    if folder not in TIERS:
        raise pytest.UsageError(f"{item.nodeid}: test files live in tests/unit, tests/inprocess or tests/e2e")
    return TIERS[folder]


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark each test with its folder's tier as it is collected, before `-m` selects (so `-m "not e2e"` is the fast
    run)."""
    item.add_marker(tier(item))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The container build first, then the other end-to-end tests, each group in pytest-randomly's order: under
    pytest-xdist the longest work then starts at once beside everything else instead of ending the run alone."""
    items.sort(key=lambda item: (item.get_closest_marker("container") is None,
                                 item.get_closest_marker("e2e") is None))


@pytest.fixture
def opened(monkeypatch) -> collections.Counter:
    """How many times each file is opened through `open` from here to the test's end, by path: what reads a file
    once reads it once."""
    counts: collections.Counter = collections.Counter()
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        counts[str(file)] += 1
        return real_open(file, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", counting_open)
    return counts
