"""The bearer-key gate of realrl's HTTP servers (docs/design.md §14).

Every route but `/health` needs `Authorization: Bearer <the trial's HTTP API
key>`. Anything else is answered 401 by the middleware, before the route's
handler runs (so it changes nothing and reads no body), and counted in
`refused`.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

OPEN_PATHS = frozenset({"/health"})
UNAUTHORIZED_BODY = '{"error": "unauthorized: this route needs Authorization: Bearer <the trial\'s key>"}'


class BearerGate:
    """`middleware` for `web.Application(middlewares=[...])`; `key` None lets everything through."""

    def __init__(self, key: str | None):
        self._expected = f"Bearer {key}".encode() if key else None
        self.refused = 0

    @property
    def enabled(self) -> bool:
        return self._expected is not None

    def allows(self, request: web.Request) -> bool:
        if self._expected is None or request.path in OPEN_PATHS:
            return True
        given = request.headers.get("Authorization", "").encode()
        return hmac.compare_digest(given, self._expected)  # constant time: no key by timing

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if not self.allows(request):
            self.refused += 1
            return web.Response(
                status=401,
                text=UNAUTHORIZED_BODY,
                content_type="application/json",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)
