"""server.client_read_timeout_s: a client that stalls while it sends a request loses its connection.

uvicorn has no such limit: its keep-alive timer stops at the first byte of a request, so a socket
that sends part of its headers, or part of its body, is held open for ever (seen: 20 of 20 such
sockets still open after 60 s). Two pieces, because the ASGI app only exists once the headers are in:
- the headers: a subclass of uvicorn's HTTP protocol closes a connection whose request head is not
  complete within the timeout of its first byte (or of the connection, before any byte);
- the body: an ASGI wrapper gives each body chunk the timeout; a stall is a 408 with
  `Connection: close`.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from starlette.exceptions import HTTPException

from fluxlab.server.early_reply import Receive, Scope, Send, send_error
from fluxlab.server.protocol import error_body

log = logging.getLogger("fluxlab.server")


class ClientTooSlow(HTTPException):
    """No body bytes for server.client_read_timeout_s (HTTP 408; the connection is closed)."""

    def __init__(self, timeout_s: float):
        super().__init__(408, f"the request body stalled for {timeout_s:g} s (server.client_read_timeout_s)",
                         headers={"connection": "close"})


class BodyReadTimeout:
    """Each body chunk must arrive within timeout_s of the app asking for it. FastAPI renders the
    ClientTooSlow raised while it reads a body with the app's error handler; one raised outside it
    (an early answer dropping a body) is answered here."""

    def __init__(self, app: Callable, timeout_s: float, on_reject: Callable[[int], None] = lambda status: None):
        self.app, self.timeout_s, self.on_reject = app, timeout_s, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.timeout_s <= 0:
            return await self.app(scope, receive, send)
        body_done, response_started = False, False

        async def timed_receive() -> dict:
            nonlocal body_done
            if body_done:  # past the body, receive() waits for a disconnect, as long as it takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                raise ClientTooSlow(self.timeout_s) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def watched_send(message: dict) -> None:
            nonlocal response_started
            response_started = True
            await send(message)

        try:
            await self.app(scope, timed_receive, watched_send)
        except ClientTooSlow as err:
            if response_started:
                raise
            self.on_reject(408)
            await send_error(send, 408, error_body(err.detail, "invalid_request_error", None, "request_timeout"),
                             close=True)


def header_deadline_protocol(base: type, timeout_s: float) -> type:
    """uvicorn's HTTP protocol class `base` (h11 or httptools: both keep the request in progress in
    `cycle`) closing a connection whose request head takes longer than timeout_s."""

    class HeaderDeadline(base):
        _head_timer: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()  # a connection that never sends a byte is closed too

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._waiting_for_head():
                if self._head_timer is None:
                    self._arm()
            elif self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _waiting_for_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(timeout_s, self._head_too_slow)

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if self._waiting_for_head() and not self.transport.is_closing():
                log.debug("closing a connection whose request head took over %g s", timeout_s)
                self.transport.close()

    return HeaderDeadline
