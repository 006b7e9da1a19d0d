"""uvicorn's HTTP/1.1 protocol with a deadline on each request's head, for every ember
HTTP service (`ember serve`, `ember router`).

uvicorn closes a kept-alive connection that stays idle (`KEEP_ALIVE_S`), but waits
forever for a request line and headers that come a byte at a time: a few slow clients
could hold every connection a worker has. Here a connection that has not sent a whole
request head within `read_timeout` seconds of connecting, or of the first byte after its
last response, gets a 408 and is closed (the body's deadline is the guard's, `guard.py`),
and a connection over `max_connections` does not count and gets a 503 as soon as its
request head is in (or after LINGER_S), so that what a flood of clients costs a process
is bounded. A refused connection is closed the lingering way: the response, then our end
of the stream, then whatever the client still sends is read and dropped until it closes
(or LINGER_S): closing a socket with bytes unread, or before the client's request has
come, resets the connection, and a client can lose the response to the reset.
`uvicorn_options` are the settings every ember service runs uvicorn with.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

from ember.server.errors import TOO_MANY_CONNECTIONS

logger = logging.getLogger("ember.server")


def _response(status: bytes, message: str, kind: str, code: str) -> bytes:
    """A whole HTTP response with an OpenAI error body, written before the connection
    closes."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})
    body = body.encode()
    head = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\n" % status
    return head + b"content-length: %d\r\n\r\n%s" % (len(body), body)


_TIMED_OUT = _response(
    b"408 Request Timeout",
    "the request head did not come in time (--read-timeout)",
    "invalid_request_error",
    "request_timeout",
)
_TOO_MANY = _response(
    b"503 Service Unavailable",
    "too many connections (--max-connections); retry later",
    "service_unavailable",
    TOO_MANY_CONNECTIONS,
)
# an idle kept-alive connection is closed after this long: longer than clients keep an
# idle connection themselves (httpx, and so the OpenAI and Anthropic SDKs and ember's
# router, 5 s), so that the client always lets it go first. A server that closes first
# races a request the client sends on it at that moment, which fails with a reset.
KEEP_ALIVE_S = 75
LINGER_S = 5.0  # how long a refused connection waits for its request head, then its close


class TimedH11Protocol(H11Protocol):
    def __init__(self, *args, read_timeout: float, max_connections: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False  # what the client sends is read and dropped
        self._answered = False  # ... and its refusal was sent
        self._tail = b""  # the last bytes a refused client sent (for the end of its head)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.connections.discard(self)  # a refused connection does not count
            self._refused = True  # answered once its head is in, or after LINGER_S
            self.loop.call_later(LINGER_S, self._refuse, _TOO_MANY)
            return
        self._arm()

    def _refuse(self, response: bytes) -> None:
        """Sends `response` (once) and ends the connection the lingering way (see above);
        the transport closes itself when the client's end of the stream comes."""
        self._refused = True
        if self._answered or self.transport.is_closing():
            return
        self._answered = True
        self.transport.write(response)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if self._refused:  # read and dropped; a refused request's head ends: its answer
            if not self._answered and b"\r\n\r\n" in self._tail + data:
                self._refuse(_TOO_MANY)
            self._tail = (self._tail + data)[-3:]
            return
        if self._waiting_for_head() and self._head_timer is None:
            self._arm()
        super().data_received(data)
        if not self._waiting_for_head():
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.read_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _timed_out(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
            logger.info(
                "closed a connection that sent no request head in %.0f s", self.read_timeout
            )
            self._refuse(_TIMED_OUT)


def uvicorn_options(read_timeout: float, max_connections: int) -> dict:
    """What every ember service gives uvicorn.Config: this protocol (the head's deadline,
    and a 503 for a connection over `max_connections`) and the idle timeout."""
    protocol = functools.partial(
        TimedH11Protocol, read_timeout=read_timeout, max_connections=max_connections
    )
    return {"http": protocol, "timeout_keep_alive": KEEP_ALIVE_S}
