"""The parser interfaces, their registries, and the buffer machinery the parsers share.

A model family writes tool calls and reasoning its own way (Hermes `<tool_call>` blocks,
Llama's JSON, Kimi's section tokens, `<think>` blocks ...). Each way is a parser
registered by name; `ember.server.parsers.select` picks one of each for the served model.
Both kinds are incremental: fed the generated text piece by piece as it is detokenized,
each returns a `ParsedText` (content, reasoning, tool-call deltas) for the piece, and a
finish step flushes what it held back. Whatever the split, the pieces add up to what
parsing the whole text at once gives.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from ember.registry import Registry

if TYPE_CHECKING:
    from ember.server.protocol import Tool


@dataclass
class ToolCallDelta:
    """A piece of one tool call. `index` numbers the calls of one choice from 0; a call's
    first piece carries its `id` and `name`, and its arguments (a JSON object as text) are
    the concatenation of the `arguments` of all its pieces."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        """The `tool_calls` entry of a streamed delta."""
        out: dict = {"index": self.index}
        function: dict = {}
        if self.id is not None:
            out.update(id=self.id, type="function")
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass
class ParsedText:
    """What a piece of generated text turned out to be."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: ParsedText) -> ParsedText:
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls += other.calls
        return self


def run_states(parser, text: str, final: bool) -> ParsedText:
    """Runs a state-machine parser over new text: `text` joins its `buffer`, its `state`
    (a method taking `final`, True while it made progress) runs until it needs more, and
    what it put in `out` is returned and cleared."""
    parser.buffer += text
    while parser.state(final):
        pass
    out, parser.out = parser.out, ParsedText()
    return out


def merge_calls(deltas: list[ToolCallDelta]) -> list[dict]:
    """Whole OpenAI tool calls (`message.tool_calls`) from the deltas of one choice."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(
            delta.index,
            {"id": None, "type": "function", "function": {"name": None, "arguments": ""}},
        )
        call["id"] = call["id"] or delta.id
        call["function"]["name"] = call["function"]["name"] or delta.name
        call["function"]["arguments"] += delta.arguments
    return [calls[i] for i in sorted(calls)]


_RANDOM = random.SystemRandom()


def new_call_id(ids: random.Random | None = None) -> str:
    """A tool call's id: random, or the next of `ids` (a request's own draws, seeded by
    its id: a stream moved to another worker draws the same ids again)."""
    return f"call_{(ids or _RANDOM).getrandbits(96):024x}"


class ToolParser(ABC):
    """Finds one model family's tool calls in its generated text, incrementally.

    Who and when: the chat endpoint makes one per choice of a request with tools and
    `tool_choice: auto`, from the request's tools, then calls `feed(text)` with each piece
    of the answer's text (reasoning already taken out) as it is detokenized, and
    `finish()` once when the sequence has ended.
    Returns: a `ParsedText` with the content that is surely not part of a call (text that
    may still begin a marker is held back, so a marker split across pieces never leaks
    into content) and the tool-call deltas found, numbered from 0. A call's arguments
    stream as soon as the format lets them be known to be arguments. `finish()` flushes
    what was held back: text that turned out not to be a call comes back as content,
    never dropped; a call cut short (max_tokens) keeps what it had.
    `markers` lists the strings the parser looks for; those that are special tokens of
    the served tokenizer must be kept in the text (skip_special_tokens off).
    """

    call_ids: random.Random | None = None  # where new call ids are drawn (see new_call_id)

    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: list[Tool] | None = None) -> None:
        self.tools = {t.function.name: t for t in tools or []}

    @abstractmethod
    def feed(self, text: str) -> ParsedText: ...

    @abstractmethod
    def finish(self) -> ParsedText: ...


class ReasoningParser(ABC):
    """Separates a reasoning model's thinking from its answer, incrementally.

    Who and when: an API surface (chat completions; Messages and Responses too) makes one
    per choice from the rendered prompt (a template may open the thinking block in the
    prompt, so that the output starts inside it), then calls `feed(text)` with each piece
    of generated text and `finish()` once at the end.
    Returns: a `ParsedText` whose `reasoning` is the thinking and whose `content` is the
    rest (for the tool parser, if any, to read next); markers never leak into either.
    """

    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, prompt: str = "") -> None:
        self.prompt = prompt

    @abstractmethod
    def feed(self, text: str) -> ParsedText: ...

    @abstractmethod
    def finish(self) -> ParsedText: ...


TOOL_PARSERS: Registry[type[ToolParser]] = Registry("tool-call parser")
REASONING_PARSERS: Registry[type[ReasoningParser]] = Registry("reasoning parser")


class Trimmed:
    """A text streamed without its leading `lead` and trailing `trail` characters: a
    trailing run of them is held back until more text follows it (and dropped at the end),
    so what was sent is always a prefix of the whole text trimmed."""

    def __init__(self, lead: str = " \t\r\n", trail: str = " \t\r\n") -> None:
        self.lead, self.trail = lead, trail
        self.num_sent = 0
        self._pending = ""

    def add(self, text: str) -> str:
        if not self.num_sent and not self._pending:
            text = text.lstrip(self.lead)
        text = self._pending + text
        body = text.rstrip(self.trail)
        self._pending = text[len(body) :]
        self.num_sent += len(body)
        return body


def take_until(buffer: str, markers: tuple[str, ...], final: bool) -> tuple[str, str | None, str]:
    """(the text before the first of `markers`, that marker, the text after it). Before a
    marker has come: (the text that cannot be the start of one, None, the rest), the rest
    being empty once the text is `final`."""
    index, marker = find_first(buffer, markers)
    if marker is None:
        keep = 0 if final else max(partial_suffix(buffer, m) for m in markers)
        index = len(buffer) - keep
    return buffer[:index], marker, buffer[index + len(marker or "") :]


def strip_prefix(buffer: str, marker: str, final: bool) -> tuple[bool | None, str]:
    """(whether the buffer, less leading whitespace, starts with `marker`, the buffer after
    the marker if it does); None while it still may (more text is needed to tell)."""
    text = buffer.lstrip()
    if text.startswith(marker):
        return True, text[len(marker) :]
    return (None if not final and marker.startswith(text) else False), buffer


def find_first(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """(index, marker) of the earliest of `markers` in text (the longest at a tie);
    (-1, None) when there is none."""
    best, found = -1, None
    for marker in markers:
        i = text.find(marker)
        if i >= 0 and (found is None or i < best or (i == best and len(marker) > len(found))):
            best, found = i, marker
    return best, found


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
