"""Freezing the start-up objects out of the garbage collector's reach, and releasing them."""

from __future__ import annotations

import gc

from libkk import Session
from libkk.runtime import heap


def test_freezes_are_counted_and_the_last_release_unfreezes():
    before = heap._holders
    heap.freeze_startup_objects()
    heap.freeze_startup_objects()
    assert gc.get_freeze_count() > 0
    heap.release_frozen_objects()
    assert gc.get_freeze_count() > 0  # one holder left
    heap.release_frozen_objects()
    assert heap._holders == before
    if before == 0:
        assert gc.get_freeze_count() == 0
    heap.release_frozen_objects()  # more releases than freezes: nothing to undo
    assert heap._holders == max(before - 1, 0)
    for _ in range(before - heap._holders):  # restore what this test released of others'
        heap.freeze_startup_objects()


def test_a_session_freezes_its_start_up_objects_until_it_closes(tiny_qwen3_dir):
    before = heap._holders
    with Session(str(tiny_qwen3_dir), device="cpu", progress=False):
        assert heap._holders == before + 1 and gc.get_freeze_count() > 0
    assert heap._holders == before
    with Session(str(tiny_qwen3_dir), device="cpu", progress=False, freeze_gc=False):
        assert heap._holders == before
