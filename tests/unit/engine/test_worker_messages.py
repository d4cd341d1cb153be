"""Rank 0's messages to tensor-parallel workers: framed as `multiprocessing.connection` frames them
(the worker reads them with `Connection.recv`), and written without SIGPIPE, so a worker that is
gone raises BrokenPipeError even in a process that keeps SIGPIPE's default action (a C host that
embeds Python: the C ABI installs no signal handlers)."""

from __future__ import annotations

import socket
import subprocess
import sys
from multiprocessing.connection import Connection

from libkk.engine.executor import message_frame, write_frame


def test_a_worker_reads_every_message_with_connection_recv():
    ours, theirs = socket.socketpair()
    worker = Connection(theirs.detach())
    messages = [{"num_blocks": 7}, None, list(range(50_000)), "x" * 20_000]
    try:
        for message in messages:
            write_frame(ours, message_frame(message))
            assert worker.recv() == message
    finally:
        ours.close()
        worker.close()


_GONE_WORKER = """
import signal, socket
from libkk.engine.executor import message_frame, write_frame

signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # what a C host embedding Python keeps
ours, theirs = socket.socketpair()
theirs.close()  # the worker is gone
try:
    write_frame(ours, message_frame({"step": 1}))
except BrokenPipeError:
    print("BrokenPipeError")
"""


def test_writing_to_a_gone_worker_raises_instead_of_killing_the_process():
    done = subprocess.run(
        [sys.executable, "-c", _GONE_WORKER], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -13: killed by SIGPIPE
    assert done.stdout.strip() == "BrokenPipeError"
