"""`ember bench serve`: an asyncio load generator for any OpenAI-compatible server.

Life cycle: build the workload (`workloads.py`) with a fixed seed; start every session as
a task, released by the arrival process (all at once, Poisson at --request-rate, or the
trace's own timestamps); each turn is one streaming chat completion, sent when a slot
under --max-concurrency is free; the stream is timed chunk by chunk (TTFT, inter-token
gaps, end to end) and its usage kept (prompt, cached and completion tokens). Sessions stop
taking new turns once --duration has passed. Then `report.py` turns the records into
the summary, the table, the JSON and the plot.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from ember.bench.workloads import Session, Turn, WordSource
from ember.headers import SESSION_HEADER, WORKER_HEADER


@dataclass
class RequestRecord:
    session_id: str
    turn: int
    start: float  # seconds since the run began
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None  # its kind ("HTTP 429", "ReadTimeout", ...), for grouping
    error_detail: str | None = None  # the server's message
    echoed_session: str | None = None
    worker: str | None = None  # the worker a router named (x-ember-worker)
    hash_ids: list[int] | None = None
    # the reply's text and tool calls, hashed: two runs' outputs compare without storing them
    reply_digest: str | None = None


@dataclass
class _Reply:
    content: str = ""
    tool_calls: dict[int, dict] = field(default_factory=dict)

    def add(self, delta: dict) -> None:
        self.content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            slot = self.tool_calls.setdefault(
                call.get("index", 0),
                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
            )
            slot["id"] = call.get("id") or slot["id"]
            function = call.get("function") or {}
            slot["function"]["name"] += function.get("name") or ""
            slot["function"]["arguments"] += function.get("arguments") or ""


class LoadGenerator:
    def __init__(self, args, sessions: list[Session], words: WordSource) -> None:
        self.args = args
        self.sessions = sessions
        self.words = words
        self.records: list[RequestRecord] = []
        self.limit = asyncio.Semaphore(args.max_concurrency or 10**9)
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.deadline = float("inf")
        self.start = 0.0
        self.started_at = 0.0  # the wall clock at `start` (seconds since the epoch)

    async def run(self) -> float:
        """Runs every session; returns the wall time."""
        total = sum(len(s.turns) for s in self.sessions)
        self.bar = tqdm(total=total, desc="requests", disable=self.args.no_progress)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(self.args.timeout, connect=30)
        async with httpx.AsyncClient(
            base_url=self.args.url, headers=self.headers, limits=limits, timeout=timeout
        ) as client:
            self.client = client
            self.start = time.perf_counter()
            self.started_at = time.time()
            if self.args.duration:
                self.deadline = self.start + self.args.duration
            arrivals = self._arrivals()
            await asyncio.gather(
                *(self._session(s, at) for s, at in zip(self.sessions, arrivals, strict=True))
            )
        self.bar.close()
        return time.perf_counter() - self.start

    def _arrivals(self) -> list[float]:
        """Session start offsets: 0 for all, or Poisson arrivals at --request-rate."""
        if not self.args.request_rate:
            return [0.0] * len(self.sessions)
        rng = random.Random(self.args.seed)
        now, times = 0.0, []
        for _ in self.sessions:
            times.append(now)
            now += rng.expovariate(self.args.request_rate)
        return times

    async def _session(self, session: Session, arrival: float) -> None:
        await self._sleep_until(arrival)
        for index, turn in enumerate(session.turns):
            if turn.send_at is not None:
                await self._sleep_until(turn.send_at)
            if time.perf_counter() >= self.deadline:
                return
            async with self.limit:
                record, reply = await self._send(session, index, turn)
            self.records.append(record)
            self.bar.update(1)
            if record.error is not None:
                return  # the history is broken; the session ends here
            if session.agentic:
                self._extend_history(session, turn, reply)
                if index + 1 < len(session.turns) and session.think_time:
                    await asyncio.sleep(session.think_time)

    async def _sleep_until(self, offset: float) -> None:
        delay = self.start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    def _body(self, session: Session, turn: Turn) -> dict:
        messages = [{"role": "system", "content": session.system}] if session.system else []
        messages += session.history if session.agentic else []
        if not (session.agentic and session.history and session.history[-1]["role"] == "tool"):
            messages += turn.messages
        body = {
            "model": self.args.model,
            "messages": messages,
            "max_tokens": turn.max_tokens,
            "temperature": self.args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.args.ignore_eos:
            body["ignore_eos"] = True
        if session.tools:
            body["tools"] = session.tools
        body.update(json.loads(self.args.extra_body))
        return body

    def _extend_history(self, session: Session, turn: Turn, reply: _Reply) -> None:
        """The reply joins the history; a tool call is answered by a tool result (the next
        turn's new message), anything else by the next user message."""
        history = session.history
        if not (history and history[-1]["role"] == "tool"):
            history.extend(turn.messages)
        calls = [reply.tool_calls[i] for i in sorted(reply.tool_calls)]
        message: dict = {"role": "assistant", "content": reply.content or None}
        if calls:
            message["tool_calls"] = calls
        history.append(message)
        for call in calls:
            result = self.words.text(self.args.turn_tokens)
            history.append({"role": "tool", "tool_call_id": call["id"], "content": result})

    async def _send(self, session: Session, index: int, turn: Turn):
        record = RequestRecord(
            session.session_id, index, time.perf_counter() - self.start, hash_ids=turn.hash_ids
        )
        send_header = session.agentic and self.args.session_header
        headers = {SESSION_HEADER: session.session_id} if send_header else {}
        reply = _Reply()
        sent = time.perf_counter()
        last = None
        try:
            async with self.client.stream(
                "POST", "/v1/chat/completions", json=self._body(session, turn), headers=headers
            ) as response:
                record.echoed_session = response.headers.get(SESSION_HEADER)
                record.worker = response.headers.get(WORKER_HEADER)
                if response.status_code != 200:
                    record.error = f"HTTP {response.status_code}"
                    record.error_detail = (await response.aread()).decode(errors="replace")[:500]
                    return record, reply
                async for line in response.aiter_lines():
                    last = self._on_line(line, record, reply, sent, last)
        except httpx.HTTPError as exc:
            record.error, record.error_detail = type(exc).__name__, str(exc)
        except _StreamError as exc:
            record.error = str(exc)
        record.e2e = time.perf_counter() - sent
        if record.error is None:
            calls = [reply.tool_calls[i].get("function") for i in sorted(reply.tool_calls)]
            text = json.dumps([reply.content, calls], sort_keys=True).encode()  # no call ids
            record.reply_digest = hashlib.sha256(text).hexdigest()[:16]
        return record, reply

    def _on_line(self, line, record: RequestRecord, reply: _Reply, sent: float, last):
        if not line.startswith("data: ") or line == "data: [DONE]":
            return last
        event = json.loads(line[6:])
        if "error" in event:
            raise _StreamError(f"stream error: {event['error'].get('type', 'error')}")
        now = time.perf_counter()
        usage = event.get("usage")
        if usage:
            record.prompt_tokens = usage.get("prompt_tokens", 0)
            record.output_tokens = usage.get("completion_tokens", 0)
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens = details.get("cached_tokens") or 0
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            record.finish_reason = choice.get("finish_reason") or record.finish_reason
            if not (delta.get("content") or delta.get("tool_calls")):
                continue
            reply.add(delta)
            if record.ttft is None:
                record.ttft = now - sent
            else:
                record.itl.append(now - last)
            last = now
        return last


class _StreamError(RuntimeError):
    pass
