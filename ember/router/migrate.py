"""Live stream migration: a stream whose worker fails goes on from another worker.

A stream the router can move (chat, completions, Anthropic's Messages or the Responses
API; one sequence of one prompt; not a Responses turn that continues a stored one, which
lives on its first worker alone; and the cluster secret, which workers need to take
`resume_params`) is relayed event by event rather than byte by byte. Its worker sends
each event with the token ids it is the text of (the token trail, `ember.server.resume`);
the router strips them and keeps, in a `Splice`, what the client has been sent: the
tokens, the number of events, the stream's id and its time (`created`, a Message's none,
a response's `created_at`), whether its finish went out (a `finish_reason`, Anthropic's
`message_delta`, the response's last event).

The worker fails when its connection breaks (killed, its host gone), when it ends the
stream with an `engine_stopped` error event (its engine died, or it is shutting down),
when the stream ends without its last event (`[DONE]`, `message_stop`, the response's
`response.completed`, or an error event of the request's own), or when no event comes
for `--stall-timeout` seconds once this worker has sent a token (the wait for a first
token, a prefill that may be long, is not timed). The router then closes that stream (a
live worker aborts the request), takes the worker out of its pool unless it only stalled,
and sends the request to another worker with `resume_params` (the tokens so far): the
new stream's events follow the ones already sent, under the same id, with no repeated
or missing token, and its final usage counts the whole request. A stream is moved at
most `--max-migrations` times (a request that kills every worker it lands on must not
take down the cluster); one that cannot be moved (no worker left, the limit reached, its
finish already sent) ends with its API's error event (and `[DONE]` on chat and
completions), as before.

Unseeded sampling moves too: the router gives a movable stream that has no `seed` one of
its own, so the new worker draws the tokens the first would have drawn (ember's draws
depend on the seed and the token's position only).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx

from ember.router.run import DEFAULT_MAX_MIGRATIONS, DEFAULT_STALL_TIMEOUT_S
from ember.server.errors import (
    ENGINE_STOPPED,
    MESSAGES_PATH,
    RESPONSES_PATH,
    error_body_for,
    error_code_of,
)
from ember.server.resume import STOPPED_MARK, split_trail

logger = logging.getLogger("ember.router")

MOVABLE_PATHS = ("/v1/chat/completions", "/v1/completions", MESSAGES_PATH, RESPONSES_PATH)
_TAIL = 4096  # bytes of the stream kept for its usage
# the events (by their `event:` name) that end a Messages or Responses stream, and those
# after which nothing is left to move (its finish went out)
_LAST = {b"message_stop", b"error", b"response.completed", b"response.incomplete",
         b"response.failed"}  # fmt: skip
_FINISHING = {b"message_delta", *_LAST}


@dataclass(frozen=True)
class Migration:
    """How the router moves streams: at most `max_migrations` times each, and after
    `stall_timeout` seconds without an event (None: never for a stall)."""

    max_migrations: int = DEFAULT_MAX_MIGRATIONS
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError("--max-migrations must be >= 0")
        if self.stall_timeout is not None and self.stall_timeout <= 0:
            raise ValueError("--stall-timeout must be > 0 (or 0 for none)")


def movable(path: str, body: dict, one_sequence: bool, secret: bytes | None) -> bool:
    """Whether the router can move this request's stream to another worker."""
    streamed = body.get("stream") is True
    stored = body.get("previous_response_id") is not None  # on its first worker alone
    return secret is not None and path in MOVABLE_PATHS and streamed and one_sequence and not stored


class Splice:
    """What the client has had of a stream: complete events pass through `feed`, their
    token trails are taken off and kept. Events a trail binds into one unit (the events
    a Messages or Responses writer makes of one chat chunk) go out together once the
    unit is whole: a stream cut inside a unit is moved from before it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.token_ids: list[int] = []
        self.response_id: str | None = None
        self.created: int | None = None
        self.num_events = 0  # sent to the client
        self.finished = False  # a finish_reason was sent: nothing is left to move
        self.done = False  # [DONE] came
        self.engine_stopped = False  # the worker's engine stopped mid-stream
        self.tail = b""  # the last bytes sent (the final usage is there)
        self._pending = b""
        self._unit: list[bytes] = []  # the events of a unit not yet whole
        self._unit_tokens: list[int] = []  # ... and its tokens
        self._unit_left = 0  # ... and how many of its events are still to come

    def restart(self) -> None:
        """A new worker's stream begins (what was half read of the last one is dropped)."""
        self._pending = b""
        self._unit, self._unit_tokens, self._unit_left = [], [], 0
        self.engine_stopped = False

    def feed(self, chunk: bytes) -> list[bytes]:
        """The complete events in `chunk` (with what came before) that go to the client."""
        self._pending += chunk
        *events, self._pending = self._pending.split(b"\n\n")
        out = []
        for event in events:
            if not event:
                continue
            tokens, more, event = split_trail(event)
            if self._unit_left == 0:  # a unit begins: this event and `more` after it
                self._unit_left = more + 1
            self._unit.append(event)
            self._unit_tokens += tokens
            self._unit_left -= 1
            if self._unit_left == 0:
                unit, self._unit = self._unit, []
                self.token_ids += self._unit_tokens
                self._unit_tokens = []
                for whole in filter(None, map(self._take, unit)):
                    out.append(whole)
                    self.tail = (self.tail + whole)[-_TAIL:]
        return out

    def resume_params(self) -> dict:
        return {"token_ids": self.token_ids, "id": self.response_id, "created": self.created,
                "events": self.num_events}  # fmt: skip

    def failure(self, status: int, message: str, code: str | None) -> bytes:
        """The last events of this stream when it cannot go on, in its API's shape."""
        if self.path == RESPONSES_PATH:  # the Responses API's error event, numbered
            event = {"type": "error", "code": code, "message": message, "param": None,
                     "sequence_number": self.num_events}  # fmt: skip
            return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
        body = json.dumps(error_body_for(self.path, status, message, None, code))
        if self.path == MESSAGES_PATH:
            return f"event: error\ndata: {body}\n\n".encode()
        return f"data: {body}\n\ndata: [DONE]\n\n".encode()

    def _take(self, event: bytes) -> bytes | None:
        """The event as the client gets it (None: not the client's), noted."""
        if not event:
            return None
        if event.startswith(STOPPED_MARK):  # a Messages or Responses engine_stopped error
            self.engine_stopped = True
            return None
        name = b""
        if event.startswith(b"event: "):
            line, _, rest = event.partition(b"\n")
            name = line[len(b"event: ") :]
        else:
            rest = event
        data = rest[6:] if rest.startswith(b"data: ") else b""
        if data == b"[DONE]" or name in _LAST:
            self.done = True
        if data.startswith(b'{"error"'):
            if error_code_of(data) == ENGINE_STOPPED:  # not the client's: the stream moves
                self.engine_stopped = True
                return None
        elif data.startswith(b"{"):
            if self.response_id is None:
                self._head(data)
            # the workers' compact JSON: an unescaped quote cannot come from inside a string
            self.finished = self.finished or b'"finish_reason":"' in data or name in _FINISHING
        self.num_events += 1
        return event + b"\n\n"

    def _head(self, data: bytes) -> None:
        """The stream's id and time, from its first event that names them: a chunk, the
        Message of `message_start`, the response of `response.created`."""
        with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
            head = json.loads(data)
            if "message" in head:
                self.response_id, self.created = head["message"]["id"], 0
            elif "response" in head:
                head = head["response"]
                self.response_id, self.created = head["id"], head["created_at"]
            else:
                self.response_id, self.created = head["id"], head["created"]


class _Stalled(Exception):
    pass


@dataclass
class Leg:
    """One worker's part of a stream: its response, and what to do once it is over."""

    upstream: httpx.Response
    url: str
    end: Callable[[bool], Awaitable[None]]  # (the worker failed) -> close, release, mark


# what opens the next leg: (the splice so far, the workers to avoid) -> a leg; the events
# that end the client's stream when the next worker refused it; None when no worker is left
Reopen = Callable[[Splice, set[str]], Awaitable["Leg | bytes | None"]]


async def moving_events(
    path: str,
    leg: Leg,
    reopen: Reopen,
    migration: Migration,
    record_usage: Callable[[bytes], None],
) -> AsyncIterator[bytes]:
    """The client's events of a stream that moves to another worker when its own fails."""
    splice, tried, moves = Splice(path), {leg.url}, 0
    try:
        while True:
            why, stalled = None, False
            start = len(splice.token_ids)
            try:
                async with contextlib.aclosing(
                    _chunks(leg.upstream, migration.stall_timeout, splice, start)
                ) as chunks:
                    async for chunk in chunks:
                        for event in splice.feed(chunk):
                            yield event
                        if splice.engine_stopped:
                            why = "lost its engine"
                            break
                    else:
                        if not splice.done:
                            why = "ended its stream early"
            except _Stalled:
                why, stalled = f"sent nothing for {migration.stall_timeout:g} s", True
            except httpx.HTTPError as exc:
                why = f"failed mid-stream ({type(exc).__name__})"
            if why is None:
                return
            ended, leg = leg, None
            await ended.end(not stalled)  # a stalled worker stays in its pool
            if splice.finished or moves >= migration.max_migrations:
                logger.warning("worker %s %s; the stream ends there", ended.url, why)
                yield _lost_stream(splice, why, moves, "no moves were left")
                return
            logger.warning("worker %s %s; moving its stream", ended.url, why)
            moves += 1
            splice.restart()
            opened = await reopen(splice, tried)
            if opened is None:
                logger.warning("no worker could take the stream of worker %s", ended.url)
                yield _lost_stream(splice, why, moves - 1, "no other worker could take it")
                return
            if isinstance(opened, bytes):
                yield opened
                return
            leg = opened
            tried.add(leg.url)
    finally:
        if leg is not None:
            await leg.end(False)
        record_usage(splice.tail)


async def _chunks(upstream: httpx.Response, timeout, splice: Splice, start: int):
    """The response's bytes; `_Stalled` when none come for `timeout` seconds after this
    leg's first token (`start`: the tokens the splice had when it began)."""
    chunks = upstream.aiter_raw().__aiter__()
    while True:
        wait = timeout if timeout is not None and len(splice.token_ids) > start else None
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), wait)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise _Stalled from None
        yield chunk


def _lost_stream(splice: Splice, reason: str, moves: int, because: str) -> bytes:
    """The last events of a stream that could not go on."""
    message = f"the worker {reason}; the stream was not moved on: {because} ({moves} moves made)"
    return splice.failure(502, message, "worker_failed")


def stream_end(splice: Splice, status: int, content: bytes) -> bytes:
    """The last events of a moved stream whose new worker refused it (`content`: its
    error body, whose message and code are relayed when it is one)."""
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        error = json.loads(content)["error"]
        if isinstance(error["message"], str):
            return splice.failure(status, error["message"], error.get("code"))
    return splice.failure(502, f"the stream could not be moved (HTTP {status})", "worker_failed")
