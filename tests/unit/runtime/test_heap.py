"""Freezing the start-up objects out of the garbage collector's reach, and releasing them."""

from __future__ import annotations

import gc
import weakref

from libkk import Session
from libkk.runtime import heap


def test_freezes_are_counted_and_a_release_frees_what_only_the_closed_holder_kept():
    before = heap._holders
    heap.freeze_startup_objects()
    kept = _Cycle()  # in a reference cycle: only the collector frees it
    probe = weakref.ref(kept)
    heap.freeze_startup_objects()  # a second session: freezes the first one's objects too
    del kept
    gc.collect()
    assert probe() is not None  # frozen: the collector does not see it
    heap.release_frozen_objects()
    assert probe() is None  # released by the close, though one holder is left
    assert heap._holders == before + 1 and gc.get_freeze_count() > 0
    heap.release_frozen_objects()
    assert heap._holders == before
    if before == 0:
        assert gc.get_freeze_count() == 0


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_session_freezes_its_start_up_objects_until_it_closes(tiny_qwen3_dir):
    before = heap._holders
    with Session(str(tiny_qwen3_dir), device="cpu", progress=False):
        assert heap._holders == before + 1 and gc.get_freeze_count() > 0
    assert heap._holders == before
    with Session(str(tiny_qwen3_dir), device="cpu", progress=False, freeze_gc=False):
        assert heap._holders == before
