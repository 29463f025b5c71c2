"""A request body size limit (server.max_request_body_bytes), enforced before anything parses it.

A pure ASGI wrapper, not a BaseHTTPMiddleware (that one hides client disconnects from handlers).
A declared Content-Length over the limit is refused without reading a byte; a chunked body is
counted as it arrives and refused as soon as it passes the limit. Not FastAPI's `max_body_size`
(Starlette's RequestBodyLimitMiddleware): for a declared length it replaces whatever the app
answers with a plain-text "Content Too Large", and every error here has the OpenAI JSON shape.
"""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from starlette.exceptions import HTTPException

from fluxlab.server.protocol import error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class BodySizeLimit:
    def __init__(self, app: Callable, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _message(self, size: str) -> str:
        return f"the request body is {size} bytes; server.max_request_body_bytes={self.max_bytes}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.max_bytes <= 0:
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _reject(send, self._message(declared.decode()))
        received = 0

        async def counted() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI passes an HTTPException raised while it reads the body through to
                    # the app's handler, which renders it in the OpenAI error shape.
                    raise HTTPException(413, self._message(f"more than {self.max_bytes}"))
            return message

        await self.app(scope, counted, send)


async def _reject(send: Send, message: str) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", None, "request_too_large")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
