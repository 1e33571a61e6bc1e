"""Settling the heap freezes long-lived objects, and garbage cycles among them are still collected later."""
import gc
import weakref

from serving.core import heap


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector can free it


def test_settle_freezes_survivors_and_a_later_settle_frees_their_cycles():
    try:
        node = Node()
        gone = weakref.ref(node)
        assert heap.settle() > 0 and gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert gone() is not None, "a frozen cycle is out of the collector's sight"
        heap.settle()
        assert gone() is None, "settling again unfreezes first, so the cycle is collected"
    finally:
        gc.unfreeze()
