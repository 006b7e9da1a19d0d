"""What `ember bench serve` sends: random requests, agentic sessions, or a replayed trace.

Text is built from plain lowercase words that are one token each under the tokenizer
given (`WordSource`), each preceded by a space, so a prompt of N words is N tokens and
a block of words tokenizes the same wherever it sits in a prompt (byte-level BPE splits
at spaces). That is what lets a trace replay reproduce its shared prefixes exactly.

A workload is a list of `Session`s; each is a sequence of turns sent one after another
(random and trace workloads are sessions of one turn). A turn's `messages` are fixed up
front, except in agentic sessions, where each turn appends the previous reply (its text
or its tool calls and their results) and a new message to the history: the context grows
every turn.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path


class WordSource:
    """Words that are exactly one token each (with their leading space)."""

    def __init__(self, tokenizer, seed: int = 0) -> None:
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        words = sorted(t[1:] for t in vocab if re.fullmatch(r"Ġ[a-z]{2,9}", t))
        if len(words) < 16:  # no byte-level BPE vocabulary: fall back to a fixed list
            words = [f"{a}{b}" for a in _SYLLABLES for b in _SYLLABLES]
        self.words = words
        self.rng = random.Random(seed)

    def draw(self, num_tokens: int, rng: random.Random | None = None) -> list[str]:
        rng = rng or self.rng
        return [rng.choice(self.words) for _ in range(max(num_tokens, 1))]

    def text(self, num_tokens: int, rng: random.Random | None = None) -> str:
        return as_text(self.draw(num_tokens, rng))


def as_text(words: list[str]) -> str:
    return "".join(" " + w for w in words)


_SYLLABLES = ["ka", "lo", "mi", "nu", "pe", "ra", "so", "ti", "va", "ze", "bo", "du"]


@dataclass
class Turn:
    messages: list[dict]  # for agentic turns: the new message(s) only
    max_tokens: int
    send_at: float | None = None  # seconds from the start (trace replay); None: asap
    hash_ids: list[int] | None = None  # trace: the prompt's blocks


@dataclass
class Session:
    session_id: str
    turns: list[Turn]
    system: str | None = None
    tools: list[dict] | None = None
    agentic: bool = False
    think_time: float = 0.0
    history: list[dict] = field(default_factory=list)


def _length(spec: str, rng: random.Random) -> int:
    """`N` or `LO:HI` (uniform)."""
    lo, _, hi = spec.partition(":")
    return rng.randint(int(lo), int(hi)) if hi else int(lo)


def random_workload(words: WordSource, args) -> list[Session]:
    rng = random.Random(args.seed)
    sessions = []
    for i in range(args.num_requests):
        prompt = words.text(_length(args.input_len, rng), rng)
        turn = Turn([{"role": "user", "content": prompt}], _length(args.output_len, rng))
        sessions.append(Session(f"req-{i}", [turn]))
    return sessions


def agentic_workload(words: WordSource, args) -> list[Session]:
    rng = random.Random(args.seed)
    shared_system = words.text(args.system_tokens, rng)
    shared_tools = _tools(words, args.num_tools, args.tool_tokens, rng)
    sessions = []
    for s in range(args.num_sessions):
        per_session = args.prefix_sharing == "per-session"
        system = words.text(args.system_tokens, rng) if per_session else shared_system
        tools = (
            _tools(words, args.num_tools, args.tool_tokens, rng) if per_session else shared_tools
        )
        turns = [
            Turn(
                [{"role": "user", "content": words.text(args.turn_tokens, rng)}],
                _length(args.output_len, rng),
            )
            for _ in range(args.num_turns)
        ]
        source = None  # what a turn's reply quotes (--quote-tokens): the session's own
        if args.session_context_tokens and turns:  # the session's own task, files read...
            first = turns[0].messages[0]
            own = random.Random(f"{args.seed}:context:{s}")  # the rest as without it
            source = words.draw(args.session_context_tokens, own)
            first["content"] = f"{as_text(source)}\n\n{first['content']}"
        if args.quote_tokens:
            own = random.Random(f"{args.seed}:quote-source:{s}")  # without a context
            _ask_for_quotes(turns, source or words.draw(args.quote_tokens * 4, own), args, s)
        sessions.append(
            Session(f"session-{s}", turns, system, tools or None, True, args.think_time)
        )
    return sessions


def _ask_for_quotes(turns: list[Turn], source: list[str], args, session: int) -> None:
    """Each turn asks for a passage of `source` (the session's context, or words drawn for
    it) back verbatim, as an agent asks for a file edited or a tool called with arguments
    it read: a reply that quotes its context."""
    for t, turn in enumerate(turns):
        rng = random.Random(f"{args.seed}:quote:{session}:{t}")
        length = min(args.quote_tokens, len(source))
        start = rng.randint(0, len(source) - length)
        passage = as_text(source[start : start + length]).strip()
        message = turn.messages[0]
        message["content"] += f"\n\nRepeat this text exactly, word for word:\n{passage}"


def _tools(words: WordSource, count: int, num_tokens: int, rng: random.Random) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": words.text(num_tokens, rng).strip(),
                "parameters": {
                    "type": "object",
                    "properties": {"query": {"type": "string"}},
                    "required": ["query"],
                },
            },
        }
        for i in range(count)
    ]


def trace_workload(words: WordSource, args) -> list[Session]:
    """Mooncake-format JSONL: each 512-token block id becomes a fixed block of
    `--trace-block-tokens` words; timestamps (ms) are scaled by `--time-scale`."""
    block = args.trace_block_tokens
    scale = block / 512
    blocks: dict[int, list[str]] = {}
    sessions = []
    for i, record in enumerate(_read_trace(args.trace, args.trace_start, args.num_requests)):
        ids = record["hash_ids"]
        for hash_id in ids:
            if hash_id not in blocks:
                blocks[hash_id] = words.draw(block, random.Random(f"{args.seed}:{hash_id}"))
        prompt = [w for hash_id in ids for w in blocks[hash_id]]
        num_tokens = min(max(round(record["input_length"] * scale), 1), len(prompt))
        output = max(round(record["output_length"] * args.trace_output_scale), 1)
        send_at = None if args.time_scale <= 0 else record["timestamp"] / 1000 * args.time_scale
        message = {"role": "user", "content": as_text(prompt[:num_tokens])}
        sessions.append(Session(f"trace-{i}", [Turn([message], output, send_at, ids)]))
    return sessions


def _read_trace(path: str | Path, start: int, count: int) -> list[dict]:
    records = []
    with open(path) as f:
        for n, line in enumerate(f):
            if n < start or not line.strip():
                continue
            records.append(json.loads(line))
            if len(records) == count:
                break
    if not records:
        raise ValueError(f"trace {path} has no records from line {start}")
    t0 = records[0]["timestamp"]
    return [dict(r, timestamp=r["timestamp"] - t0) for r in records]


def build_workload(words: WordSource, args) -> list[Session]:
    builders = {"random": random_workload, "agentic": agentic_workload, "trace": trace_workload}
    return builders[args.workload](words, args)
