"""Streams that move between workers (the router's live migration), the worker's half.

A router that may have to move a stream asks its worker for the stream's token trail (the
request header `x-ember-stream-tokens: 1`): every SSE event of a one-sequence stream then
opens with a comment line naming the token ids it is the text of, those output since the
previous event (`: tokens 791,11,2054`). SSE clients skip comment lines; the router strips
them. An event may carry no token (the role chunk) and a token may have no event of its
own (text held back: it travels with the next event), so the trail up to an event is
exactly the output whose text the client has been sent by then.

When the worker fails mid-stream, the router sends the same request to another worker
with `resume_params`: the tokens of the trail so far and the stream's `id` and
`created`. That worker makes those tokens the request's output so far (their KV
recomputed, or found in its prefix cache or the shared tiers), replays them through the
detokenizer, the stop strings and the tool-call and reasoning parsers without sending
anything, and streams on from the next token under the same id: the client's stream goes
on as if nothing had happened. It sends no role chunk, echo or prompt logprobs again;
its usage counts the whole request (the resumed tokens are output tokens).

`resume_params` is the router's own field: like `kv_transfer_params` only a worker with
the cluster secret takes it (and such a worker serves its router alone), and it is
checked whole (types, lengths, the vocabulary, the grammar) before the engine sees it.
"""

from __future__ import annotations

import re

import msgspec

from ember.server.errors import APIError

TRAIL_PREFIX = b": tokens "  # the comment line of a token trail
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class ResumeParams(msgspec.Struct, forbid_unknown_fields=True):
    """Where a moved stream goes on from: the tokens its client has had, its id and time."""

    token_ids: list[int]
    id: str
    created: int


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
    if not _ID.fullmatch(resume.id) or resume.created < 0:
        raise _refused("resume_params: id must be 1-128 of [A-Za-z0-9_-], created >= 0")
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

    def mark(self, event: bytes, token_ids: list[int]) -> bytes:
        if not self.enabled or len(token_ids) <= self.num_marked:
            return event
        new = token_ids[self.num_marked :]
        self.num_marked = len(token_ids)
        return TRAIL_PREFIX + ",".join(map(str, new)).encode() + b"\n" + event
