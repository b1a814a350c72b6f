"""The pure-ASGI guard in front of the app: API keys for ``/v1/*``, 503 while draining, and the
body-size cap (checked on ``Content-Length`` and while a chunked body streams in).

The server may have several API keys (``--api-key k1,k2``). The key a request used is passed
on as ``scope["flexpage.key_scope"]``: a short digest of it, never the key itself, which
scopes conversations (one key's conversation id never reaches another key's KV)."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Callable

from fastapi.responses import JSONResponse

from flexpage.server.protocol import APIError
from flexpage.server.state import ServerState

__all__ = ["Guard", "error_response"]

_KNOWN_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/kv", "/health", "/metrics",
                "/openapi.json")


def key_scope(key: str) -> str:
    """What names an API key inside the server: 16 hex digits of its sha256."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]



class Guard:
    """Auth, draining and body-size checks before FastAPI parses anything."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = [500]

        async def counted_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if path.startswith("/v1"):
                await self._guarded(scope, receive, counted_send)
            else:
                await self.app(scope, receive, counted_send)
        finally:
            if self.state.metrics is not None:
                self.state.metrics.http.labels(path if path in _KNOWN_PATHS else "other", str(status[0])).inc()

    async def _guarded(self, scope: dict, receive: Callable, send: Callable) -> None:
        state = self.state
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if state.api_keys:
            scheme, _, credential = headers.get("authorization", "").strip().partition(" ")
            token = credential.strip() if scheme.lower() == "bearer" else ""
            # every key compared (no early exit): the time taken says nothing about which matched
            matches = [hmac.compare_digest(token.encode(), key.encode()) for key in state.api_keys]
            if any(matches):
                scope["flexpage.key_scope"] = key_scope(state.api_keys[matches.index(True)])
            else:
                if token:
                    message = "invalid API key"
                elif scheme and scheme.lower() != "bearer":
                    message = f"unsupported authorization scheme {scheme[:20]!r} (send 'Authorization: Bearer <key>')"
                else:
                    message = "missing API key (send 'Authorization: Bearer <key>')"
                await _send_error(send, APIError(401, message, type="authentication_error", code="invalid_api_key",
                                                 headers={"www-authenticate": "Bearer"}))
                return
        if state.draining:
            await _send_error(send, APIError(503, "the server is shutting down", type="service_unavailable",
                                             code="shutting_down"))
            return
        limit = state.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            await _send_error(send, _too_large(int(declared), limit), close=True)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_error(send, _too_large(size, limit, at_least=True), close=True)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        state.inflight += 1
        try:
            await self.app(scope, replay, send)
        finally:
            state.inflight -= 1


def _too_large(size: int, limit: int, at_least: bool = False) -> APIError:
    got = f"at least {size}" if at_least else str(size)
    return APIError(413, f"request body is {got} bytes; the limit is {limit} bytes (--max-request-body)",
                    code="request_too_large")


async def _send_error(send: Callable, error: APIError, close: bool = False) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in error.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
