"""Plain ASGI middleware (no response buffering, so streams and disconnects pass straight through).

`AuthMiddleware` checks the bearer key in constant time; `AccessLogMiddleware` writes one JSON
log line per request and counts it by route and status. Neither ever logs prompt text.
"""

from __future__ import annotations

import hmac
import json
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import error_body
from server.state import RequestRecord, ServerState

access_logger = logging.getLogger("driftgate.server.access")
_PUBLIC_WHEN_METRICS_PUBLIC = frozenset({"/health", "/ping", "/metrics"})


def route_path(scope: Scope) -> str:
    """The request's path below the server's --root-path, which uvicorn puts back in front of the
    path the proxy passed on (the ASGI convention)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


async def _send_json(send: Send, status: int, body: dict, headers: list[tuple[bytes, bytes]]) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()), *headers]})
    await send({"type": "http.response.body", "body": payload})


class AuthMiddleware:
    """401 unless `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) matches, when
    the server has a key."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        config = self.state.config
        if scope["type"] != "http" or config.api_key is None:
            return await self.app(scope, receive, send)
        if config.metrics_public and route_path(scope) in _PUBLIC_WHEN_METRICS_PUBLIC:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer":
            token = headers.get(b"x-api-key", b"")
        # compare_digest runs in time independent of where the strings differ
        if token and hmac.compare_digest(token.strip(), config.api_key.encode()):
            return await self.app(scope, receive, send)
        await _send_json(send, 401, error_body(401, "missing or invalid API key"),
                         [(b"www-authenticate", b"Bearer")])


class AccessLogMiddleware:
    """One structured line per HTTP request (route, status, tokens, TTFT, total time), and its count
    by route and status; --disable-uvicorn-access-log keeps the count and drops the line."""

    def __init__(self, app: ASGIApp, state: ServerState, routes: frozenset[str]) -> None:
        self.app = app
        self.state = state
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        status = 0
        completed = False

        async def send_wrapper(message: Message) -> None:
            nonlocal status, completed
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                completed = True
            await send(message)

        scope.setdefault("state", {})
        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:  # unhandled: the error middleware outside this one answers 500 (or the stream breaks)
            status, completed = 500, True
            raise
        finally:
            self._log(scope, status if completed else 499, time.monotonic() - started)

    def _log(self, scope: Scope, status: int, total_s: float) -> None:
        route = route_path(scope)
        route = route if route in self.routes else "other"
        self.state.metrics.http_requests.labels(route, str(status)).inc()
        if not self.state.config.access_log:
            return
        record: RequestRecord | None = scope["state"].get("record")
        line = {"event": "request", "method": scope["method"], "route": route, "status": status,
                "total_s": round(total_s, 4)}
        if record is not None:
            line.update(id=record.request_id, outcome=record.outcome, prompt_tokens=record.prompt_tokens,
                        output_tokens=record.output_tokens,
                        ttft_s=None if record.ttft_s is None else round(record.ttft_s, 4))
        access_logger.info(json.dumps(line))
