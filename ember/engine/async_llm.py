"""An asyncio interface that streams each request's outputs step by step.

The engine runs in one background thread that owns it; coroutines talk to that thread
through a command queue and get outputs back through one asyncio queue per request.
Life cycle: `AsyncLLM(...)` loads the model and starts the thread; `generate()` yields a
RequestOutput per step (with `delta_*` fields) until the request finishes; leaving the
iterator early (client gone, task cancelled) aborts the request and frees its blocks;
`shutdown()` aborts what is left and stops the thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ember.config import EngineConfig
from ember.engine.core import EngineStats
from ember.engine.llm_engine import LLMEngine
from ember.engine.processor import ProcessedPrompt
from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams

logger = logging.getLogger("ember.engine")


@dataclass
class _Add:
    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    cache_salt: str | None
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class AsyncLLM:
    def __init__(self, model: str | None = None, **options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **options))
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Add] = {}
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._stopping = False
        self._stats = self.engine.stats()  # published by the engine thread after each step
        self._thread = threading.Thread(target=self._loop, name="ember-engine", daemon=True)
        self._thread.start()

    @property
    def dead(self) -> bool:
        return not self._thread.is_alive()

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; raises ValueError for bad input before any."""
        if self.dead:
            raise EngineDeadError(f"engine loop has stopped: {self._error!r}")
        request_id = request_id or f"req-{next(self._ids)}"
        processed = self.engine.process_prompt(prompt)
        self.engine.input_processor.check(processed, params)
        sink: asyncio.Queue = asyncio.Queue()
        self._commands.put(
            _Add(request_id, processed, params, cache_salt, sink, asyncio.get_running_loop())
        )
        finished = False
        try:
            while not finished:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        """The engine's load as of its last step (safe from any thread)."""
        return self._stats

    def shutdown(self) -> None:
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout=30)

    # -- the engine thread --------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
                self._stats = self.engine.stats()
        except BaseException as exc:  # the engine is broken
            logger.exception("engine loop died")
            self._error = exc
        finally:  # fail every live request, free its blocks
            error = EngineDeadError(repr(self._error) if self._error else "engine shut down")
            for request_id, add in list(self._sinks.items()):
                add.loop.call_soon_threadsafe(add.sink.put_nowait, error)
                self.engine.abort_request(request_id)
            self._sinks.clear()

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(block=block)
            while True:
                self._apply(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _apply(self, command) -> None:
        if command is None:
            self._stopping = True
        elif isinstance(command, _Add):
            try:
                self.engine.add_request(
                    command.request_id, command.prompt, command.params, command.cache_salt
                )
                self._sinks[command.request_id] = command
            except ValueError as exc:
                command.loop.call_soon_threadsafe(command.sink.put_nowait, exc)
        elif isinstance(command, _Abort) and self._sinks.pop(command.request_id, None):
            self.engine.abort_request(command.request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            add = self._sinks.get(output.request_id)
            if add is None:
                continue
            if output.finished:
                del self._sinks[output.request_id]
            add.loop.call_soon_threadsafe(add.sink.put_nowait, output)
