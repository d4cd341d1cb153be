"""Keeping Python's garbage collector off the start-up objects.

A loaded model and its libraries leave hundreds of thousands of long-lived Python objects (about
309,000 for a tiny model on the CPU, where a full collection took 138 ms: benchmarks/gc_pause.py),
and compiling adds FX graphs, guards, Inductor and Triton state. A full collection walks all of
them, and the first one comes during the first requests, since everything start-up allocated is
still counted as new. Like
vLLM and SGLang, libkk collects once when a model is ready and moves every live object into the
collector's permanent generation (`gc.freeze`), so later collections only walk what steps
allocate. Frozen objects are not collected while frozen: a session that closes unfreezes, collects
(its model's objects go, GPU tensors held in reference cycles included) and freezes again what the
sessions still open hold.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0  # open sessions that froze the heap


def freeze_startup_objects() -> None:
    """Collects, then freezes every live object; pair with `release_frozen_objects`."""
    global _holders
    with _lock:
        gc.collect()
        gc.freeze()
        _holders += 1


def release_frozen_objects() -> None:
    """For a closing session that froze: unfreezes, collects, and freezes again if other sessions
    that froze are still open."""
    global _holders
    with _lock:
        _holders = max(_holders - 1, 0)
        gc.unfreeze()
        gc.collect()
        if _holders:
            gc.freeze()
