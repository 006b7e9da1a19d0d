"""Tool calls written as JSON objects `{"name": ..., "arguments": {...}}`: Hermes
`<tool_call>` blocks, Llama 3.x's bare JSON, and Mistral's `[TOOL_CALLS]` (both its JSON
array and the newer `[TOOL_CALLS]name[ARGS]{...}` form).

Formats (what the models' chat templates write, and the parsers read back):
    hermes   <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (any number)
    llama3   [<|python_tag|>]{"name": "f", "parameters": {...}}[; {...}]   (the whole answer)
    mistral  [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]           (v3 tokenizers)
             [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}               (v11 and later;
             v13 puts [CALL_ID]id after the name)
"""

from __future__ import annotations

import json
import random
import re
import string

from ember.server.parsers.base import TOOL_PARSERS, strip_prefix, take_until
from ember.server.parsers.calls import WHITESPACE, StreamingToolParser

# the text of an object before its arguments, when the name comes first
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*$', re.S
)


def call_of(data: object) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a decoded call object; None if it is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return data["name"], arguments


class JsonCallReader:
    """Reads one call object, fed in pieces from its opening brace on, for a parser.

    When the object names the function before its arguments (as every template writes
    it), the call starts when the arguments object opens, and its text streams into the
    parser's call as it is scanned, up to the brace that closes it. Otherwise the object
    is read whole and `result()` parses it once it has closed (or the text ended).
    """

    def __init__(self, parser: StreamingToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.pos = 0  # scanned up to here
        self.depth = 0
        self.in_string = self.escape = False
        self.mode = "head"  # head | stream (arguments) | tail (after them) | whole
        self.sent = 0  # argument text sent up to here
        self.end: int | None = None  # just past the closing brace, once it came

    @property
    def streamed(self) -> bool:
        return self.mode in ("stream", "tail")

    @property
    def rest(self) -> str:
        """The text after the object (once it has closed)."""
        return self.text[self.end :] if self.end is not None else ""

    def feed(self, text: str) -> None:
        self.text += text
        while self.end is None and self.pos < len(self.text):
            self._scan(self.text[self.pos])
            self.pos += 1
        if self.mode == "stream":
            self.parser.add_arguments(self.text[self.sent : self.pos])
            self.sent = self.pos

    def _scan(self, char: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif char == "\\":
                self.escape = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
            if self.depth == 2 and char == "{" and self.mode == "head":
                self._arguments_open()
        elif char in "}]":
            self.depth -= 1
            if self.depth == 1 and self.mode == "stream":
                self.parser.add_arguments(self.text[self.sent : self.pos + 1])
                self.mode = "tail"
            if self.depth == 0:
                self.end = self.pos + 1

    def _arguments_open(self) -> None:
        head = _HEAD.match(self.text[: self.pos])
        if head is None:
            self.mode = "whole"
            return
        self.parser.start_call(json.loads(head.group(1)))
        self.mode, self.sent = "stream", self.pos

    def result(self) -> tuple[str, str] | None:
        """The call of an object read whole; None if it is not one."""
        try:
            return call_of(json.loads(self.text[: self.end]))
        except json.JSONDecodeError:
            return None


class JsonCallsParser(StreamingToolParser):
    """A run of call objects, separated by `separators`, closed by `closer` (if any) or by
    whatever is not an object (content again)."""

    separators = WHITESPACE
    closer: str | None = None

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        self.reader: JsonCallReader | None = None

    def between_calls(self, final: bool) -> bool:
        self.buffer = self.buffer.lstrip(self.separators)
        if self.buffer.startswith("{"):
            self.reader = JsonCallReader(self)
            self.state = self.in_call
            return True
        if self.closer and self.buffer.startswith(self.closer):
            self.buffer = self.buffer[len(self.closer) :]
        elif not self.buffer and not final:
            return False
        self.state = self.in_content
        return True

    def in_call(self, final: bool) -> bool:
        reader = self.reader
        reader.feed(self.buffer)
        self.buffer = ""
        if reader.end is None and not final:
            return False
        self.buffer, self.state = reader.rest, self.between_calls
        if not reader.streamed:
            call = reader.result()
            if call is None:  # not a call after all: it was content
                self.out.content += reader.text[: reader.end]
                self.state = self.in_content
            else:
                self.add_call(*call)
        return True


OPEN, CLOSE = "<tool_call>", "</tool_call>"


@TOOL_PARSERS.register("hermes")
class HermesToolParser(StreamingToolParser):
    """`<tool_call>` blocks anywhere in the answer (Hermes, Qwen 2.5/3, SmolLM2 through
    ember's own tool prompt). A block that holds no call stays content, tags and all."""

    markers = (OPEN, CLOSE)

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        self.block = ""  # the open block's text, given back as content if it is no call
        self.reader: JsonCallReader | None = None

    def in_content(self, final: bool) -> bool:
        if self.content_until((OPEN,), final) is None:
            return False
        self.block, self.reader, self.state = "", None, self.in_block
        return True

    def in_block(self, final: bool) -> bool:
        text, close, self.buffer = take_until(self.buffer, (CLOSE,), final)
        self.block += text
        if self.reader is not None:
            self.reader.feed(text)
        elif self.block.lstrip().startswith("{"):
            self.reader = JsonCallReader(self)
            self.reader.feed(self.block.lstrip())
        if close is None and not final:
            return False
        if self.reader is None or not self.reader.streamed:
            call = self.reader.result() if self.reader is not None else None
            if call is None:
                self.out.content += OPEN + self.block + (close or "")
            else:
                self.add_call(*call)
        self.state = self.in_content
        return True


PYTHON_TAG = "<|python_tag|>"


@TOOL_PARSERS.register("llama3")
class Llama3ToolParser(JsonCallsParser):
    """Llama 3.1-3.3 JSON calls: the answer is one or more `{"name", "parameters"}`
    objects separated by `;`, optionally after `<|python_tag|>`; an answer that starts
    otherwise is content (a `<|python_tag|>` later in it starts calls)."""

    markers = (PYTHON_TAG,)
    separators = WHITESPACE + ";"

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        self.state = self.at_start

    def at_start(self, final: bool) -> bool:
        tagged, self.buffer = strip_prefix(self.buffer, PYTHON_TAG, final)
        if tagged is None:
            return False
        if tagged or self.buffer.lstrip().startswith("{"):
            self.state = self.between_calls
        else:
            self.state = self.in_content
        return True

    def in_content(self, final: bool) -> bool:
        if self.content_until((PYTHON_TAG,), final) is None:
            return False
        self.state = self.between_calls
        return True


TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ALPHANUMERIC = string.ascii_letters + string.digits


@TOOL_PARSERS.register("mistral")
class MistralToolParser(JsonCallsParser):
    """Mistral's `[TOOL_CALLS]`: a JSON array of calls, or (v11+) `name[ARGS]{...}`
    after each `[TOOL_CALLS]`. Call ids are 9 letters and digits, as Mistral's templates
    require of the ids they are sent back."""

    markers = (TOOL_CALLS, ARGS, CALL_ID)
    separators = WHITESPACE + ","
    closer = "]"

    def new_call_id(self) -> str:
        return "".join((self.call_ids or random).choices(_ALPHANUMERIC, k=9))

    def in_content(self, final: bool) -> bool:
        if self.content_until((TOOL_CALLS,), final) is None:
            return False
        self.state = self.after_marker
        return True

    def after_marker(self, final: bool) -> bool:
        text = self.buffer.lstrip()
        if not text and not final:
            return False
        if text.startswith("["):  # the JSON array
            self.buffer, self.state = text[1:], self.between_calls
        elif text.startswith("{"):
            self.buffer, self.state = text, self.between_calls
        else:
            self.state = self.in_name
        return True

    def in_name(self, final: bool) -> bool:
        head, marker, rest = take_until(self.buffer, (ARGS, "{"), final)
        if marker is None and not final:
            return False
        self.buffer = "{" + rest if marker == "{" else rest
        name, _, call_id = head.partition(CALL_ID)
        if marker is None:  # the text ended before any arguments: no call
            self.out.content += TOOL_CALLS + head if head.strip() else ""
        else:
            self.start_call(name.strip(), call_id.strip() or None)
        self.state = self.in_arguments if marker else self.in_content
        return True

    def in_arguments(self, final: bool) -> bool:
        end = self.stream_arguments((TOOL_CALLS,), final)
        if end is None:
            return False
        self.state = self.after_marker
        return True
