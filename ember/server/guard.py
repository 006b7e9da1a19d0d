"""What every ember HTTP service checks before a handler runs (an ASGI middleware).

In order, before any of the body is read:
1. who may call: the API (`/v1/*`, `/tokenize`, `/detokenize`) needs an API key when
   any is set (`Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's clients
   send it); on a worker that has the cluster secret, it needs the router's token instead
   (`x-ember-router-token`): such a worker serves its router and no one else. With
   `protect_metrics`, `/load` and `/metrics` need the key or the router's token too.
   `/health` is always open (probes). With several keys, the key's tenant goes with the
   request (`request.state.tenant`; from a router, its `x-ember-tenant` header).
2. the body's size: a request whose Content-Length exceeds `max_request_bytes` is a 413
   at once; a body without one is read up to the limit, then handed on (or refused);
3. the body's time: it must all come within `read_timeout` seconds of the head, else a
   408 (the head's own deadline is `http_protocol.py`'s), so a client that trickles its
   body holds no handler.
Every refusal is an OpenAI error body (Anthropic's shape on `/v1/messages`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember import cluster
from ember.headers import ROUTER_TOKEN_HEADER, TENANT_HEADER
from ember.server.errors import error_body_for
from ember.server.limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_READ_TIMEOUT_S

PROTECTED = ("/load", "/metrics")
API_PATHS = ("/tokenize", "/detokenize")  # besides /v1/*: the tokenizer, as vLLM has it


def is_api(path: str) -> bool:
    """Whether `path` is the API that the key (or on a worker, the router's token) guards."""
    return path.startswith("/v1/") or path in API_PATHS


@dataclass(frozen=True)
class Access:
    """Who may call an ember HTTP service, and how much it may send. With several API keys
    each key is a tenant, and (unless `key_salts` is off) its requests' prefix-cache
    blocks are its own: the tenant salts every block hash, so no tenant can hit, or time,
    another's cached prefix."""

    api_keys: tuple[str, ...] = ()
    cluster_secret: bytes | None = None  # a worker of a cluster: serves its router only
    protect_metrics: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    read_timeout: float = DEFAULT_READ_TIMEOUT_S
    key_salts: bool = True

    def admit(self, path: str, headers: Headers) -> tuple[JSONResponse | None, str | None]:
        """(the 401 for a caller not allowed on `path`, or None; the caller's tenant, if
        its prefix cache is its own). A cluster's router names the tenant of the key it
        checked in `x-ember-tenant`."""
        protected = is_api(path) or (self.protect_metrics and path in PROTECTED)
        if not protected:
            return None, None
        if cluster.is_router(self.cluster_secret, headers.get(ROUTER_TOKEN_HEADER)):
            tenant = headers.get(TENANT_HEADER)
            return None, tenant if tenant and _TENANT.fullmatch(tenant) else None
        if self.cluster_secret is not None and is_api(path):
            message = "this worker serves only its cluster's router"
            return _refuse(401, message, "invalid_api_key", path), None
        if not self.api_keys and self.cluster_secret is None:
            return None, None
        key = self._key_shown(headers)
        if key is None:
            return _refuse(401, "missing or invalid API key", "invalid_api_key", path), None
        return None, tenant_of(key) if len(self.api_keys) > 1 and self.key_salts else None

    def _key_shown(self, headers: Headers) -> str | None:
        """The key the request shows, if it is one of ours (every key compared)."""
        bearer = headers.get("authorization", "").encode()
        shown = headers.get("x-api-key", "").encode()
        found = None
        for key in self.api_keys:
            if hmac.compare_digest(bearer, f"Bearer {key}".encode()) | hmac.compare_digest(
                shown, key.encode()
            ):
                found = key
        return found


_TENANT = re.compile(r"[0-9a-f]{32}")


def tenant_of(key: str) -> str:
    """A key's tenant: a name derived from it that does not give it away."""
    return hashlib.sha256(b"ember-tenant:" + key.encode()).hexdigest()[:32]


def tenant_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The cache salt of a request: its tenant's, with the client's own `cache_salt`."""
    if tenant is None:
        return cache_salt
    return f"tenant:{tenant}:{cache_salt or ''}"


class Guard:
    """The ASGI middleware that applies an `Access` to every HTTP request."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal, tenant = self.access.admit(scope["path"], headers)
        if tenant is not None:  # read as request.state.tenant
            scope.setdefault("state", {})["tenant"] = tenant
        if refusal is None:
            refusal, receive = await self._limit_body(headers, receive, scope["path"])
            if receive is None:  # the client left while it sent the body: no one to answer
                return
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _limit_body(self, headers: Headers, receive: Receive, path: str):
        """(a 413 or 408 or None, the receive to hand on, None if the client left): the
        body read here, within its size and its time."""
        limit = self.access.max_request_bytes
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return _too_large(limit, path), receive
        try:
            async with asyncio.timeout(self.access.read_timeout):
                return await self._read_body(receive, limit, path)
        except TimeoutError:  # and the connection is closed: the rest of the body may follow
            message = f"the request body did not come within {self.access.read_timeout:g} s"
            refusal = _refuse(408, message, "request_timeout", path)
            refusal.headers["connection"] = "close"
            return refusal, receive

    async def _read_body(self, receive: Receive, limit: int, path: str):
        chunks, size = [], 0
        while True:  # the server holds the client to a Content-Length; chunked: the limit
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect
                return None, None
            size += len(message.get("body", b""))
            if size > limit:
                return _too_large(limit, path), receive
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                return None, _replay(body, receive)


def _replay(body: Message, receive: Receive) -> Receive:
    """A receive that first returns the body already read, then the client's own."""
    pending = [body]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


def _too_large(limit: int, path: str) -> JSONResponse:
    return _refuse(
        413,
        f"the request body is larger than this server accepts ({limit} bytes; --max-request-bytes)",
        "request_too_large",
        path,
    )


def _refuse(status: int, message: str, code: str, path: str) -> JSONResponse:
    return JSONResponse(error_body_for(path, status, message, None, code), status_code=status)
