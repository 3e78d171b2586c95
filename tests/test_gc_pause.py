"""server/gc_pause.py: what is alive at start leaves the collector's full passes, and a slow pass is logged."""

from __future__ import annotations

import gc
import logging

import pytest

from server import gc_pause


@pytest.fixture
def frozen():
    yield
    gc.unfreeze()
    while gc_pause._timed in gc.callbacks:
        gc.callbacks.remove(gc_pause._timed)


def test_the_startup_heap_is_frozen_once_and_slow_passes_are_logged(frozen, caplog, monkeypatch) -> None:
    gc_pause.freeze_startup_heap()
    gc_pause.freeze_startup_heap()
    assert gc.get_freeze_count() > 10_000 and gc.callbacks.count(gc_pause._timed) == 1
    monkeypatch.setattr(gc_pause, "SLOW_S", -1.0)  # every full pass is slow now
    with caplog.at_level(logging.WARNING, logger="s2s.gc"):
        gc.collect(1)  # not a full pass: not timed
        assert not caplog.records
        gc.collect()
    assert [r.message for r in caplog.records if "garbage collection" in r.message]
