"""Answering a request before the app has read its body (401, 413, 503, 408) in the OpenAI error shape.

A client that writes its whole body before it reads the answer (httpx's async client, AsyncOpenAI)
gets a connection reset, not the answer, when the server closes with body bytes still unread: the
kernel answers them with a reset, which throws away the answer the client had received. So the
rest of the body is read and dropped first (nothing is kept or parsed), up to DISCARD_LIMIT_BYTES,
and then the answer leaves the connection open. A larger body, one that stalls, or a client that
waits for `100 Continue` (it has not sent its body) gets the answer with `Connection: close`.
"""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, Optional

from starlette.exceptions import HTTPException

from fluxlab.server.protocol import error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

# Read and dropped before an early answer; past it the connection is closed instead. Reading costs
# only the client's bandwidth (the bytes are neither kept nor parsed).
DISCARD_LIMIT_BYTES = 64 * 1024 * 1024


async def discard_body(receive: Receive, limit_bytes: int = DISCARD_LIMIT_BYTES) -> bool:
    """Read the rest of the request body and drop it; True once it ended within limit_bytes, False
    when it was longer, the client left, or it stalled past server.client_read_timeout_s."""
    received = 0
    try:
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return False
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
            if received > limit_bytes:
                return False
    except HTTPException:  # the read timeout (client_timeouts.ClientTooSlow)
        return False


def can_discard(scope: Scope, limit_bytes: int = DISCARD_LIMIT_BYTES) -> bool:
    """Whether reading the body first is worth it: not when it is declared larger than the limit,
    nor when the client waits for `100 Continue` before it sends it."""
    headers = dict(scope.get("headers") or ())
    if headers.get(b"expect", b"").lower() == b"100-continue":
        return False
    declared = headers.get(b"content-length")
    return not (declared is not None and declared.isdigit() and int(declared) > limit_bytes)


async def reply_early(scope: Scope, receive: Receive, send: Send, status: int, message: str, type: str,
                      code: Optional[str], close: bool = False) -> None:
    """Drop what is left of the body (when it is worth it), then answer `status` with an OpenAI error;
    `close`: close the connection even when the whole body was read."""
    body_read = can_discard(scope) and await discard_body(receive)
    await send_error(send, status, error_body(message, type, None, code), close=close or not body_read)


async def send_error(send: Send, status: int, payload: dict, close: bool) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
