"""`run_server`: serves `build_app(session)` with uvicorn until SIGTERM or Ctrl-C.

On the signal the server stops accepting connections and refuses new requests; requests in flight
get `shutdown_grace_s` to finish, then are aborted (streams end with finish_reason "abort" and
`data: [DONE]`); what still hangs after a few more seconds is cancelled. The function then
returns, so the caller closes the session and exits with status 0.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import uvicorn

from libkk.api.session import Session
from libkk.serve.app import build_app

# After the grace period: time for aborted requests to send their last chunk before uvicorn
# cancels what is left.
_CANCEL_AFTER_S = 5.0


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self._libkk = app.state.libkk

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._libkk.begin_shutdown()
        super().handle_exit(sig, frame)


def _ignore(sig: int, frame: FrameType | None) -> None:
    pass


def run_server(
    session: Session,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    shutdown_grace_s: float = 10.0,
    access_log: bool = False,
    log_level: str = "info",
) -> None:
    """Serves the OpenAI API for `session` on host:port; returns after a clean shutdown."""
    app = build_app(session, model_name=model_name, shutdown_grace_s=shutdown_grace_s)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=shutdown_grace_s + _CANCEL_AFTER_S,
    )
    server = _Server(config, app)
    # NOTE: after a graceful shutdown uvicorn raises the signal it caught again, for the handler
    # that was installed before it; with these, that ends nothing and run_server returns.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
