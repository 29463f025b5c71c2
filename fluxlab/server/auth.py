"""server.api_key: every path but /health asks for `Authorization: Bearer <key>` (DESIGN §12).

A pure ASGI guard in front of the whole app, so the key is checked before anything reads or parses
the body (an unauthenticated 8 MB body used to be parsed before its 401) and the paths FastAPI adds
itself (/docs, /redoc, /openapi.json) are closed as well. Routers and Prometheus scrapers are given
the key (sglang-router: --api-key).
"""
from __future__ import annotations

import hmac
from typing import Callable, Optional

from fluxlab.server.early_reply import Receive, Scope, Send, reply_early

OPEN_PATHS = frozenset({"/health"})


class ApiKeyGuard:
    def __init__(self, app: Callable, api_key: Optional[str], on_reject: Callable[[int], None] = lambda status: None):
        self.app, self.on_reject = app, on_reject
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.expected is None or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):  # compare_digest: no timing hint about the key
            return await self.app(scope, receive, send)
        self.on_reject(401)
        await reply_early(scope, receive, send, 401, "invalid or missing API key (Authorization: Bearer ...)",
                          "invalid_request_error", "invalid_api_key")
