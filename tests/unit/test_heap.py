"""heap.start_up: the collector off while a role starts, its garbage gone and the rest frozen after."""
import gc
import weakref

import pytest

from dapo_megatron import heap


class _Node:
    pass


def _cycle() -> _Node:
    node = _Node()
    node.me = node  # only the cyclic collector frees it
    return node


@pytest.fixture
def collector_on():
    """The collector on after the test, as the suite runs (its heap frozen after collection:
    tests/conftest.py; what a test here freezes stays so, a few objects)."""
    yield
    gc.enable()


def test_the_starts_garbage_is_collected_and_what_lives_is_frozen(collector_on):
    with heap.start_up():
        assert not gc.isenabled()  # no full scans while the start imports and builds
        dead = weakref.ref(_cycle())
        kept = _cycle()
        assert dead() is not None  # nothing collected it meanwhile
    assert gc.isenabled()
    assert dead() is None  # collected before the freeze: frozen garbage would never go
    assert gc.get_freeze_count() > 0 and not any(o is kept for o in gc.get_objects())  # later scans skip it


def test_an_error_in_the_start_leaves_the_collector_as_it_was(collector_on):
    gc.disable()  # a process that runs without the collector keeps it off
    with pytest.raises(ValueError):
        with heap.start_up():
            raise ValueError("the start failed")
    assert not gc.isenabled() and gc.get_freeze_count() > 0
    gc.enable()
    with pytest.raises(ValueError):
        with heap.start_up():
            raise ValueError("the start failed")
    assert gc.isenabled()


def test_as_a_decorator_each_call_is_a_start(collector_on):
    """The roles mark their start methods with it (a rank's setup, an actor's __init__)."""
    seen = []

    @heap.start_up()
    def setup():
        seen.append(gc.isenabled())
        return _cycle()

    kept = setup()
    assert seen == [False] and gc.isenabled() and not any(o is kept for o in gc.get_objects())
