"""The start-up gate (serving/core/startup.py): it opens once the initial load is over and every port is open.
Servers that start in that order run in tests/e2e/test_startup_order.py."""
from __future__ import annotations

import threading
import time

from serving.core.startup import Startup


def test_startup_opens_once_loaded_and_every_port_is_open():
    gate = Startup(ports=1)
    assert not gate.wait(time.monotonic() + 0.05)
    gate.loaded()
    assert not gate.done and not gate.wait(time.monotonic() + 0.05)
    opened = []
    waiter = threading.Thread(target=lambda: opened.append(gate.wait(None)))
    waiter.start()
    time.sleep(0.05)
    gate.port_opened()
    waiter.join(5)
    assert opened == [True] and gate.done
    gate.loaded()  # said again by a second watcher of the load: nothing changes
    assert gate.wait(time.monotonic())
