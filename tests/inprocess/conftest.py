"""The DataPlane fixture the in-process modules share: real DataPlanes in this process, without gunicorn or sockets,
which each module calls through Flask's test client or a gRPC servicer."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING

import pytest

from server_harness import in_process_core

if TYPE_CHECKING:
    from serving.core import DataPlane


@pytest.fixture(scope="module")
def dataplane() -> Iterator[Callable[..., DataPlane]]:
    """A factory of DataPlanes, one per call with the ServerOptions the module overrides, all closed when the module
    ends. Each is server_harness.in_process_core's (models loaded and ready), except with `loaded=False`: for a
    config whose models have no versions on disk, where there is nothing to wait for and no readiness to reach."""
    with ExitStack() as stack:
        def make(loaded: bool = True, **options: object) -> DataPlane:
            if loaded:
                return stack.enter_context(in_process_core(**options))
            from serving.config import ServerOptions
            from serving.core import DataPlane

            core = DataPlane.create(ServerOptions(file_system_poll_wait_seconds=0, **options))
            stack.callback(core.close)
            return core
        yield make
