"""Streams that move between workers (the router's live migration), the worker's half.

A router that may have to move a stream asks its worker for the stream's token trail (the
request header `x-ember-stream-tokens: 1`): every SSE event of a one-sequence stream then
opens with a comment line naming the token ids it is the text of, those output since the
previous event (`: tokens 791,11,2054`). SSE clients skip comment lines; the router strips
them. An event may carry no token (the role chunk) and a token may have no event of its
own (text held back: it travels with the next event), so the trail up to an event is
exactly the output whose text the client has been sent by then. A trail may end with
` +K` (`: tokens 5,6 +2`, or `: tokens +2` with no token): its event and the K after it
are one unit, which the router passes on whole or not at all.

When the worker fails mid-stream, the router sends the same request to another worker
with `resume_params`: the tokens of the trail so far and the stream's `id` and
`created`. That worker makes those tokens the request's output so far (their KV
recomputed, or found in its prefix cache or the shared tiers), replays them through the
detokenizer, the stop strings and the tool-call and reasoning parsers without sending
anything, and streams on from the next token under the same id: the client's stream goes
on as if nothing had happened. It sends no role chunk, echo or prompt logprobs again;
its usage counts the whole request (the resumed tokens are output tokens).

The Messages and Responses APIs are translations of the chat stream (`serving_messages`,
`serving_responses`): their writers carry each chat frame's trail onto the first event
they write for it or after it (`TrailCarry`), and rebuild their state on a resumed
stream from the resumed tokens' text (`RequestContext.replayed`) without writing it;
`events` says how many events the client has had (the Responses API numbers them). An
`engine_stopped` error event of theirs opens with STOPPED_MARK, so the router knows it
from an error of the request's own.

Such a writer may make several events of one chat chunk (a block's start and its first
delta); their trail binds them into one unit, so a stream cut between them is resumed
from before them, never from the middle of what one chunk said.

`resume_params` is the router's own field: like `kv_transfer_params` only a worker with
the cluster secret takes it (and such a worker serves its router alone), and it is
checked whole (types, lengths, the vocabulary, the grammar) before the engine sees it.
"""

from __future__ import annotations

import re

import msgspec

from ember.server.errors import APIError

TRAIL_PREFIX = b": tokens "  # the comment line of a token trail
STOPPED_MARK = b": engine stopped\n"  # opens a translated stream's engine_stopped error
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class ResumeParams(msgspec.Struct, forbid_unknown_fields=True):
    """Where a moved stream goes on from: the tokens its client has had, its id and time,
    and how many events it has had."""

    token_ids: list[int]
    id: str
    created: int
    events: int = 0


def resume_of(body, secret: bytes | None) -> ResumeParams | None:
    """The request's checked `resume_params` (a 400 naming it when malformed, when the
    request is not a one-sequence stream, or when this worker has no cluster secret)."""
    value = getattr(body, "resume_params", None)
    if value is None:
        return None
    if secret is None:
        raise _refused(
            "resume_params is accepted only from the router of an ember cluster "
            "(this worker has no EMBER_CLUSTER_SECRET)"
        )
    try:
        resume = msgspec.convert(value, ResumeParams)
    except msgspec.ValidationError as exc:
        raise _refused(f"resume_params: {exc}") from None
    if not _ID.fullmatch(resume.id) or resume.created < 0 or resume.events < 0:
        raise _refused("resume_params: id must be 1-128 of [A-Za-z0-9_-], created and events >= 0")
    if not body.stream:
        raise _refused("resume_params: only a stream is resumed")
    return resume


def _refused(message: str) -> APIError:
    return APIError(400, message, "resume_params", "invalid_value")


class TokenTrail:
    """Opens each event of a stream with the tokens output since the previous event (when
    the router asked for them; otherwise events pass unchanged)."""

    def __init__(self, enabled: bool, num_resumed: int = 0) -> None:
        self.enabled = enabled
        self.num_marked = num_resumed  # a resumed stream's router knows those already

    def mark(self, event: bytes, token_ids: list[int], more: int = 0) -> bytes:
        """`event` opened with the tokens not marked yet; `more`: the events after it that
        are of its unit (a chat answer's last text and its finish_reason are one)."""
        if not self.enabled or (len(token_ids) <= self.num_marked and not more):
            return event
        new = token_ids[self.num_marked :]
        self.num_marked = len(token_ids)
        return trail_line(new, more) + event


class TrailCarry:
    """The token trails of the chat frames an API layered on the chat stream translates,
    moved onto the frames it writes: `take` strips a chat frame's trail and keeps its
    tokens; `put` gets the frames written for that chat frame and gives them out as one
    unit, the first opened with the trail of every token kept (or holds them, while the
    chat frame's own unit goes on: they go out with the frames of its last chat frame)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self._left = 0  # chat frames still to come of the chat unit being read
        self._rest = False  # every frame from here on is of one unit (`hold_rest`)
        self._held: list[bytes] = []

    def take(self, frame: bytes) -> bytes:
        tokens, more, frame = split_trail(frame)
        self.token_ids += tokens
        self._left = self._left - 1 if self._left else more
        return frame

    def hold_rest(self) -> None:
        """Makes the frames held and all those to come one unit, given out by the `put`
        marked `last` (a writer that says its answer's end only after the chat stream's
        end: the last text goes out with it)."""
        self._rest = True

    def put(self, frames: list[bytes], last: bool = False) -> list[bytes]:
        self._held += frames
        if not self._held or (not last and (self._left or self._rest)):
            return []
        frames, self._held = self._held, []
        if not self.token_ids and len(frames) == 1:
            return frames
        line = trail_line(self.token_ids, len(frames) - 1)
        self.token_ids = []
        return [line + frames[0], *frames[1:]]


def trail_line(token_ids: list[int], more: int = 0) -> bytes:
    """The comment line that opens an event with its tokens, and binds the `more` events
    after it into its unit."""
    bound = b" +%d" % more if more else b""
    return TRAIL_PREFIX + ",".join(map(str, token_ids)).encode() + bound + b"\n"


def split_trail(event: bytes) -> tuple[list[int], int, bytes]:
    """(an event's trail tokens, how many events after it are of its unit, the event
    without its trail)."""
    if not event.startswith(TRAIL_PREFIX):
        return [], 0, event
    line, _, event = event.partition(b"\n")
    tokens, _, more = line[len(TRAIL_PREFIX) :].partition(b"+")
    tokens = tokens.strip()
    return [int(t) for t in tokens.split(b",")] if tokens else [], int(more or 0), event
