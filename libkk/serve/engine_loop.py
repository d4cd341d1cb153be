"""EngineLoop: one thread that steps the session for every request the server submitted.

Requests from all HTTP handlers sit in the one engine together, so each step batches them. The
event loop never waits on the session's lock: submission (tokenizing, compiling a grammar) runs on
a worker thread, aborts are handed to the stepping thread, and outputs come back through each
request's sink (which schedules them onto the event loop).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from libkk.api.session import Prompt, Session
from libkk.engine.outputs import RequestOutput
from libkk.errors import SessionClosedError, UnknownRequestError
from libkk.sample.params import SamplingParams

log = logging.getLogger(__name__)

# Receives each output of a request in order, or the exception that ended it.
Sink = Callable[[RequestOutput | BaseException], None]


class EngineLoop:
    """Steps `session` while any request it submitted is unfinished.

    Invariants: a request's sink is registered before the request is submitted (so no output is
    lost) and removed once its finished output (or an error) was delivered; an abort asked for
    while the submission is still running is carried out once it lands."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._sinks: dict[str, Sink] = {}
        self._submitted: set[str] = set()
        self._cancelled: set[str] = set()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="libkk-serve-steps", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Aborts every request still running and ends the thread (after its current step)."""
        self.cancel_all()
        with self._lock:
            self._stopped = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for rid, sink in self._take_all_sinks().items():
            self._abort(rid)
            sink(SessionClosedError("the server is shutting down"))

    @property
    def num_running(self) -> int:
        with self._lock:
            return len(self._sinks)

    def submit(
        self,
        prompts: Sequence[Prompt],
        params: Sequence[SamplingParams],
        rids: Sequence[str],
        sink: Sink,
    ) -> None:
        """Submits one request per (prompt, params, rid), all reporting to `sink`. Blocking (it
        tokenizes and may wait for a step): call it from a worker thread. On an error, aborts what
        it submitted and raises."""
        with self._lock:
            if self._stopped:
                raise SessionClosedError("the server is shutting down")
            for rid in rids:
                self._sinks[rid] = sink
        done: list[str] = []
        try:
            for prompt, p, rid in zip(prompts, params, rids, strict=True):
                self._session.submit(prompt, p, request_id=rid)
                done.append(rid)
                with self._lock:
                    self._submitted.add(rid)
                self._wake.set()
        except BaseException:
            with self._lock:
                for rid in rids:
                    self._sinks.pop(rid, None)
                    self._submitted.discard(rid)
                    self._cancelled.discard(rid)
            for rid in done:
                self._abort(rid)
            raise

    def cancel(self, rids: Sequence[str]) -> None:
        """Aborts these requests (their final outputs, finish_reason "abort", still reach the
        sink). Does not block; a request that already finished is left alone."""
        with self._lock:
            self._cancelled.update(rid for rid in rids if rid in self._sinks)
        self._wake.set()

    def cancel_all(self) -> None:
        with self._lock:
            self._cancelled.update(self._sinks)
        self._wake.set()

    # ---- the stepping thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stopped:
                    return
                aborts = self._cancelled & self._submitted
                self._cancelled -= aborts
                busy = bool(self._submitted)
            for rid in aborts:
                self._abort(rid)
            if not busy:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self._session.step()
            except Exception as exc:  # noqa: BLE001 - every waiting request hears of it
                log.exception("engine step failed")
                for rid, sink in self._take_all_sinks().items():
                    self._abort(rid)
                    sink(exc)
                continue
            for output in outputs:
                with self._lock:
                    sink = self._sinks.get(output.request_id)
                    if output.finished:
                        self._forget(output.request_id)
                if sink is not None:
                    sink(output)
            # NOTE: gives the GIL away between steps, so that a thread waiting for the session's
            # lock (a submission) takes it now rather than after several steps.
            time.sleep(0)

    def _abort(self, rid: str) -> None:
        try:
            self._session.abort(rid)
        except UnknownRequestError:
            pass  # finished (its final output is on its way) or never submitted
        except Exception:  # noqa: BLE001 - a failed engine must not end the stepping thread
            log.exception("aborting %s failed", rid)

    def _forget(self, rid: str) -> None:
        self._sinks.pop(rid, None)
        self._submitted.discard(rid)
        self._cancelled.discard(rid)

    def _take_all_sinks(self) -> dict[str, Sink]:
        with self._lock:
            sinks = dict(self._sinks)
            self._sinks.clear()
            self._submitted.clear()
            self._cancelled.clear()
        return sinks
