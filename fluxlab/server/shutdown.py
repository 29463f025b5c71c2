"""What SIGTERM starts: no new requests, in-flight ones finish for up to server.drain_timeout_s, then end.

From the signal on, every new request (also one on a keep-alive connection that uvicorn has not
closed yet, in the ~100 ms before its shutdown begins) is a 503 in the OpenAI shape, and /health
says 503 too, so a router stops sending here. In-flight requests may finish for drain_timeout_s
(rolling restarts behind sglang-router); then each is aborted: it ends with finish_reason "abort"
(a stream with its last chunk and [DONE]) and frees its pages. A request that got past the 503
while the abort went out is aborted as soon as the engine has it (`abort_if_stopped`).
"""
from __future__ import annotations

import asyncio
import signal
import threading
from typing import Awaitable, Callable

from fluxlab.server.early_reply import Receive, Scope, Send, reply_early

# How long uvicorn waits, once in-flight requests were aborted, for their responses to end before
# it cancels them (each ends within one engine step).
ABORT_GRACE_S = 2.0


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def block_stop_signals() -> None:
    """Leave SIGTERM/SIGINT to the main thread (a helper thread's first call, or an executor's
    initializer). The kernel hands a process signal to any thread that does not block it; caught
    on a helper thread, the main thread may serve a request that came in with the signal before
    Python runs the handler, and that request would miss its 503."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)


def start_blind_to_stop_signals(thread: threading.Thread) -> None:
    """thread.start() with the stop signals blocked in it from its first instruction on."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class Shutdown:
    def __init__(self, drain_timeout_s: float, abort_all: Callable[[], None], abort: Callable[[str], None]):
        self.drain_timeout_s = max(0.0, drain_timeout_s)
        self._abort_all, self._abort = abort_all, abort
        self.stopping = False  # new requests are refused
        self.aborted = False  # in-flight requests were told to end

    def begin(self) -> None:
        """The signal: refuse new requests. Only a flag: this runs inside a signal handler."""
        self.stopping = True

    async def run(self, server_shutdown: Awaitable[None]) -> None:
        """Await uvicorn's shutdown (it stops listening and waits for open responses) while the
        drain runs out, then abort whatever is still in flight."""
        self.begin()
        timer = asyncio.get_running_loop().call_later(self.drain_timeout_s, self.abort_in_flight)
        try:
            await server_shutdown
        finally:
            timer.cancel()

    def abort_in_flight(self) -> None:
        if not self.aborted:
            self.aborted = True
            self._abort_all()

    def abort_if_stopped(self, request_id: str) -> None:
        """For a request the engine took just now: it may have missed abort_all by a moment."""
        if self.aborted:
            self._abort(request_id)


class RefuseWhileStopping:
    """The 503 for every request that arrives once the shutdown began."""

    def __init__(self, app: Callable, shutdown: Shutdown, on_reject: Callable[[int], None] = lambda status: None):
        self.app, self.shutdown, self.on_reject = app, shutdown, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.shutdown.stopping:
            return await self.app(scope, receive, send)
        self.on_reject(503)
        await reply_early(scope, receive, send, 503, "the server is shutting down; send the request to another "
                          "replica or retry", "server_error", "shutting_down", close=True)
