"""What the tool-call parsers share: a buffer read by a state machine, and calls built
piece by piece.

Life cycle of one parser (one choice): `feed` appends a piece of text to `buffer` and
runs the current state until it has to wait for more; `finish` runs the states once more
with `final` set, so that none waits and everything left is decided. A state is a method
`(final) -> bool`: it consumes what it can decide of the buffer, may switch `state`, and
returns True when the next state can go on at once (False: it waits for more text).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from ember.server.parsers.base import (
    ParsedText,
    ToolCallDelta,
    ToolParser,
    Trimmed,
    new_call_id,
    run_states,
    take_until,
)

if TYPE_CHECKING:
    from ember.server.protocol import Tool

WHITESPACE = " \t\r\n"


class StreamingToolParser(ToolParser):
    def __init__(self, tools: list[Tool] | None = None) -> None:
        super().__init__(tools)
        self.buffer = ""
        self.state: Callable[[bool], bool] = self.in_content
        self.out = ParsedText()
        self.num_calls = 0
        self._arguments: Trimmed | None = None

    def feed(self, text: str) -> ParsedText:
        return run_states(self, text, final=False)

    def finish(self) -> ParsedText:
        return run_states(self, "", final=True)

    @abstractmethod
    def in_content(self, final: bool) -> bool:
        """The first state: plain content, until the format's first marker."""

    # -- helpers for the states --------------------------------------------------------

    def content_until(self, markers: tuple[str, ...], final: bool) -> str | None:
        """Emits content up to the first of `markers`; that marker (consumed), or None."""
        text, marker, self.buffer = take_until(self.buffer, markers, final)
        self.out.content += text
        return marker

    def read_until(self, markers: tuple[str, ...], final: bool) -> tuple[str, str | None] | None:
        """(the text before the first of `markers`, that marker), consumed once the marker
        has come (or the text ended: marker None); None while it has to wait."""
        text, marker, rest = take_until(self.buffer, markers, final)
        if marker is None and not final:
            return None
        self.buffer = rest
        return text, marker

    def new_call_id(self) -> str:
        return new_call_id(self.call_ids)

    def start_call(self, name: str, call_id: str | None = None) -> None:
        self.out.calls.append(ToolCallDelta(self.num_calls, call_id or self.new_call_id(), name))
        self.num_calls += 1

    def add_arguments(self, text: str) -> None:
        """Appends argument text to the call started last."""
        if not text:
            return
        calls = self.out.calls
        if calls and calls[-1].index == self.num_calls - 1:
            calls[-1].arguments += text
        else:
            calls.append(ToolCallDelta(self.num_calls - 1, arguments=text))

    def add_call(self, name: str, arguments: str) -> None:
        self.start_call(name)
        self.add_arguments(arguments)

    def stream_arguments(
        self, ends: tuple[str, ...], final: bool, trail: str = WHITESPACE
    ) -> str | None:
        """Moves the current call's arguments (the text up to the first of `ends`, less
        surrounding whitespace and trailing `trail`) from the buffer into the call as they
        come. The end found (consumed), or None while none has (or the text ended without
        one). Arguments that end empty are `{}`."""
        if self._arguments is None:
            self._arguments = Trimmed(trail=trail)
        text, end, self.buffer = take_until(self.buffer, ends, final)
        self.add_arguments(self._arguments.add(text))
        if end is None and not final:
            return None
        if not self._arguments.num_sent:
            self.add_arguments("{}")
        self._arguments = None
        return end
