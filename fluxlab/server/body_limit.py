"""A request body size limit (server.max_request_body_bytes), enforced before anything parses it.

A pure ASGI wrapper, not a BaseHTTPMiddleware (that one hides client disconnects from handlers).
A declared Content-Length over the limit is refused without keeping a byte; a chunked body is
counted as it arrives and refused as soon as it passes the limit. Either way the rest of the body
is read and dropped before the 413 (early_reply: else async clients see a reset, not the 413).
Not FastAPI's `max_body_size` (Starlette's RequestBodyLimitMiddleware): for a declared length it
replaces whatever the app answers with a plain-text "Content Too Large", and every error here has
the OpenAI JSON shape.
"""
from __future__ import annotations

from typing import Callable

from starlette.exceptions import HTTPException

from fluxlab.server.early_reply import DISCARD_LIMIT_BYTES, Receive, Scope, Send, discard_body, reply_early


class BodySizeLimit:
    def __init__(self, app: Callable, max_bytes: int, on_reject: Callable[[int], None] = lambda status: None):
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    def _message(self, size: str) -> str:
        return f"the request body is {size} bytes; server.max_request_body_bytes={self.max_bytes}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.max_bytes <= 0:
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            self.on_reject(413)
            return await reply_early(scope, receive, send, 413, self._message(declared.decode()),
                                     "invalid_request_error", "request_too_large")
        received = 0

        async def counted() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    read_all = message.get("more_body", False) is False or \
                        await discard_body(receive, DISCARD_LIMIT_BYTES - received)
                    # FastAPI passes an HTTPException raised while it reads the body through to
                    # the app's handler, which renders it in the OpenAI error shape (and counts it).
                    raise HTTPException(413, self._message(f"more than {self.max_bytes}"),
                                        headers=None if read_all else {"connection": "close"})
            return message

        await self.app(scope, counted, send)
