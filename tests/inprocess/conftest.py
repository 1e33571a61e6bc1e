"""The DataPlane fixture the in-process modules share: real DataPlanes in this process, without gunicorn or sockets,
which each module calls through Flask's test client or a gRPC servicer."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING

import pytest

from server_harness import in_process_dataplane

if TYPE_CHECKING:
    from serving.core import DataPlane


@pytest.fixture(scope="module")
def make_dataplane() -> Iterator[Callable[..., DataPlane]]:
    """A factory of DataPlanes, one per call with the DataPlaneOptions the module overrides, all closed when the
    module ends: server_harness.in_process_dataplane's (its `loaded=False` for models with no versions on disk)."""
    with ExitStack() as stack:
        def make(loaded: bool = True, **options: object) -> DataPlane:
            return stack.enter_context(in_process_dataplane(loaded, **options))
        yield make
