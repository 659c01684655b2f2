"""The training loop's frozen heap (dfm/platform/frozen_heap.py)."""

import gc
import weakref

from dfm.platform.frozen_heap import setup_objects_frozen


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_objects_made_before_are_frozen_until_the_end():
    gc.unfreeze()
    before = Node()
    with setup_objects_frozen():
        assert gc.get_freeze_count() > 0
        assert not any(obj is before for obj in gc.get_objects())  # out of every generation
        during = Node()
        assert any(obj is during for obj in gc.get_objects())  # the steps' own objects are walked
    assert gc.get_freeze_count() == 0
    assert any(obj is before for obj in gc.get_objects())


def test_cycles_made_before_are_collected_after_the_end():
    gc.unfreeze()
    cycle = Node()
    alive = weakref.ref(cycle)
    with setup_objects_frozen():
        del cycle
        gc.collect()
        assert alive() is not None  # frozen: a collection inside the loop leaves it
    gc.collect()
    assert alive() is None


def test_nested_freeze_leaves_the_outer_one_frozen():
    gc.unfreeze()
    with setup_objects_frozen():
        outer = gc.get_freeze_count()
        with setup_objects_frozen():
            pass
        assert gc.get_freeze_count() >= outer > 0
    assert gc.get_freeze_count() == 0
