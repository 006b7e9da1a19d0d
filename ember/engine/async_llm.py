"""An asyncio frontend that streams each request's outputs, the engine core in its own process.

The frontend tokenizes and checks requests (InputProcessor), sends them to the engine
core process (EngineCoreClient, ZeroMQ), and turns the core's token ids back into text
(OutputProcessor) in a reader thread, so neither HTTP work nor detokenization ever
stalls the engine loop, and the event loop never waits on the engine.

Life cycle: `AsyncLLM(...)` starts the core and waits until it is ready (given
`wait=False`, `connect()` waits); `generate()`
(or `add_request()`, which sends at once and returns a `RequestStream`) yields a
RequestOutput per engine step (with `delta_*` fields) until the request finishes;
leaving the iterator early (client gone, task cancelled) aborts the request and frees
its blocks; if the core dies every live request fails with EngineDeadError and, given
`restarts`, a new core is started (after a backoff; `dead` meanwhile);
`shutdown()` stops the core and the reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from ember import startup
from ember.config import EngineConfig
from ember.engine.core_client import EngineCoreClient, EngineDeadError
from ember.engine.messages import AbortRequests, EngineCoreOutputs, EngineStats, Preparing
from ember.engine.output_processor import OutputProcessor
from ember.engine.processor import InputProcessor, ProcessedPrompt, Truncation
from ember.kv.params import KVTransferParams
from ember.loader.checkpoint import open_checkpoint
from ember.model_config import ModelConfig
from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream"]

logger = logging.getLogger("ember.engine")

RESTART_BACKOFF_S = (1.0, 30.0)  # the first wait before restarting a core, and the longest


class _Preparing:
    """A request between `AsyncLLM.preparing()` and its sending (`sent` then)."""

    sent = False


# the request the running task prepares (tasks it starts see it too)
_PREPARING: ContextVar[_Preparing | None] = ContextVar("ember_preparing", default=None)


@dataclass
class _Sink:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    seq: int = 0  # sequences sent to the core up to and including this request's

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class RequestStream:
    """The outputs of one request the core has been sent, as an async iterator.

    It ends after the finished output, or raises the request's error (ValueError: the
    core refused it; EngineDeadError). `close()` before that aborts the request, and so
    does dropping the stream unfinished (e.g. a response body that never started)."""

    def __init__(self, request_id: str, queue: asyncio.Queue, abort, loop) -> None:
        self.request_id = request_id
        self.finished = False
        self._queue = queue
        self._abort = abort
        self._finalizer = weakref.finalize(self, _abort_from_gc, loop, abort, request_id)
        self._finalizer.atexit = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.finished:
            self._end()
        return item

    def close(self) -> None:
        """Aborts the request unless it has ended (once; later calls do nothing)."""
        if self._finalizer.detach() is not None:
            self.finished = True
            self._abort(self.request_id)

    def _end(self) -> None:
        self.finished = True
        self._finalizer.detach()


def _abort_from_gc(loop: asyncio.AbstractEventLoop, abort, request_id: str) -> None:
    try:  # the collector may run anywhere, even inside a held lock: abort on the loop
        loop.call_soon_threadsafe(abort, request_id)
    except RuntimeError:  # the loop is closed: nothing is left to abort for
        pass


class AsyncLLM:
    """`AsyncLLM(model, **options)` starts its engine core; `AsyncLLM(core=client)` takes
    one already started (`ember serve` starts it before importing the HTTP stack)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        core: EngineCoreClient | None = None,
        restarts: int = 0,
        wait: bool = True,
        **options,
    ) -> None:
        if core is None:
            from ember.loader.default_models import resolve_model

            core = EngineCoreClient(EngineConfig(model=str(resolve_model(model)), **options))
        elif model is not None or options:
            raise ValueError("AsyncLLM(core=...) takes its model and options from the core")
        config = core.config
        self.role = config.kv_role
        self.block_size = config.block_size
        # how a step is shaped, for /load (`ember plan profile` reads them)
        self.step_limits = {
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_prefill_step_tokens": config.max_prefill_step_tokens,
            "max_step_ms": config.max_step_ms,
            "min_prefill_tokens": config.min_prefill_tokens,
            # set, or auto (/load adds what auto comes to now: target_itl_ms)
            "target_itl_auto": config.target_itl_ms is None,
        }
        # the ranks a model's experts are split over (expert parallel), for /metrics
        self.expert_ranks = config.tensor_parallel_size if config.expert_parallel else 1
        self.parallel = {  # how the model is split over ranks, for /load
            "tensor_parallel_size": config.tensor_parallel_size,
            "pipeline_parallel_size": config.pipeline_parallel_size,
            "expert_parallel": config.expert_parallel,
            "data_parallel_attention": config.data_parallel_attention,
        }
        self.kv_store = config.kv_store  # the cluster tier it shares, if any
        self.client = core  # loads the model while we load the tokenizer
        self._lock = threading.Lock()  # guards the output processor and the sinks
        self._sinks: dict[str, _Sink] = {}
        self._ids = itertools.count()
        self._num_sequences_sent = 0
        self._num_preparing = 0  # requests in `preparing()` not yet sent
        self._num_announced = 0  # what the last message to the core said of them
        self._error: EngineDeadError | None = None
        self._stopping = False
        self._stop = threading.Event()  # shutdown() ends a restart's wait
        self._restarts_left = restarts
        self.num_restarts = 0
        self.restarting = False
        self.on_gone: Callable[[], None] | None = None  # called when no restart is left
        self._expert_tokens: list[tuple[int, list[int]]] = []
        self._stats = EngineStats(0, 0, 0, 0, 0, 0, 0)  # (its KV blocks: the ready core's)
        self._reader = threading.Thread(target=self._read_loop, name="ember-output", daemon=True)
        try:
            checkpoint = open_checkpoint(config.model)  # tokenizer and config; no weights read
            self.model_config = ModelConfig.from_hf(checkpoint.hf_config)
            self.tokenizer = checkpoint.tokenizer()
            # (max_model_len is the core's, once it is ready)
            self.input_processor = InputProcessor.for_model(self.tokenizer, self.model_config, 0)
            self.output_processor = OutputProcessor(self.tokenizer)
            startup.mark("tokenizer")
            if wait:
                self.connect()
        except BaseException:
            self.client.shutdown()
            raise

    def connect(self) -> None:
        """Waits until the engine core is ready, then starts taking its outputs. The
        constructor does it, unless given `wait=False`: `ember serve` builds its app and
        its HTTP server's config first, while the core still loads."""
        ready = self.client.wait_ready()  # (a failure: shutdown() stops the core)
        startup.mark("core ready")
        self.max_model_len = self.input_processor.max_model_len = ready.max_model_len
        self.core_startup = ready.startup  # the core's start-up phases (ember.startup)
        self._stats = EngineStats(0, 0, 0, 0, ready.num_kv_blocks, 0, 0)
        self._reader.start()

    @property
    def dead(self) -> bool:
        return self._error is not None

    @property
    def num_waiting(self) -> int:
        """Sequences not yet running: waiting in the core, or sent and not yet taken by it.

        Exact on the event loop: a request counts from the moment `add_request` sends it,
        and the core reports what it has taken and what still waits in the same message."""
        stats = self._stats
        return stats.num_waiting + max(self._num_sequences_sent - stats.num_sequences_received, 0)

    def process_prompt(
        self,
        prompt: str | list[int],
        add_special_tokens: bool = True,
        truncation: Truncation | None = None,
        max_tokens: int | None = None,
    ) -> ProcessedPrompt:
        return self.input_processor.tokenize(prompt, add_special_tokens, truncation, max_tokens)

    async def generate(
        self,
        prompt: str | list[int] | ProcessedPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        **options,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; raises ValueError for bad input before any.
        Options as for `add_request`."""
        stream = self.add_request(prompt, params, request_id, **options)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def add_request(
        self,
        prompt: str | list[int] | ProcessedPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        session_id: str | None = None,
        grammar: str | None = None,
        kv_transfer: KVTransferParams | None = None,
        kv_retention: str | None = None,
        resume_token_ids: list[int] | None = None,
    ) -> RequestStream:
        """Checks the request and sends it to the core now (call on the event loop; no
        await, so a caller can check `num_waiting` and add without anyone in between).
        Raises ValueError for bad input, EngineDeadError once the core is gone.

        `kv_transfer`: run as a prefill for a decode worker (`do_remote_decode`), or as a
        decode whose prompt KV and first tokens come from a prefill worker (its first
        output, carrying those tokens, comes at once).

        `resume_token_ids`: a stream resumed from another worker (n = 1): the tokens it
        had output there are this request's first output, which comes at once (a server
        replays it through its parsers without sending it); the next token is sampled after
        them, as it would have been there."""
        if self._error is not None:
            raise EngineDeadError(str(self._error), started=False)
        mark = _PREPARING.get()
        if mark is not None and not mark.sent:  # on its way no more
            mark.sent = True
            self._num_preparing -= 1
        request_id = request_id or f"req-{next(self._ids)}"
        if not isinstance(prompt, ProcessedPrompt):
            prompt = self.process_prompt(prompt)
        core_request = self.input_processor.process(
            request_id, prompt, params, cache_salt, session_id, grammar, kv_transfer,
            kv_retention, resume_token_ids,
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        sink = _Sink(asyncio.Queue(), loop)
        with self._lock:
            if request_id in self._sinks:
                raise ValueError(f"request_id {request_id!r} is already in use")
            prefilled = kv_transfer.remote_prefill if kv_transfer is not None else None
            ended = self.input_processor.resumed_finish(
                resume_token_ids, params, core_request.max_tokens
            )
            first = self.output_processor.add_request(
                request_id, prompt, params, prefilled, resume_token_ids, ended
            )
            if first is not None:  # queued now, before any output of the core's
                sink.queue.put_nowait(first)
                if first.finished:  # resumed at its end: nothing to run
                    return RequestStream(request_id, sink.queue, self.abort, loop)
            self._sinks[request_id] = sink
        core_request.num_preparing = self._num_announced = self._num_preparing
        try:
            self.client.send(core_request)
        except BaseException:
            self._forget(request_id)
            raise
        self._num_sequences_sent += params.n
        sink.seq = self._num_sequences_sent
        return RequestStream(request_id, sink.queue, self.abort, loop)

    @property
    def num_preparing(self) -> int:
        """Requests in `preparing()` not sent to the core yet."""
        return self._num_preparing

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        """Counts the request the calling task serves (checks, template, tokenizer) as on
        its way to the core until `add_request` sends it, or the block ends without: each
        request sent says how many others are, and an idle core waits a moment for them
        (`EngineCore.hold_ms`), so that requests that came together share a step. Call
        on the event loop."""
        mark = _Preparing()
        token = _PREPARING.set(mark)
        self._num_preparing += 1
        try:
            yield
        finally:
            _PREPARING.reset(token)
            if not mark.sent:
                self._num_preparing -= 1
                if self._num_announced > self._num_preparing:  # the core may wait for it
                    self._num_announced = self._num_preparing
                    with contextlib.suppress(EngineDeadError):
                        self.client.send(Preparing(self._num_preparing), wait=False)

    def abort(self, request_id: str) -> None:
        if self._forget(request_id) and self.client.alive:
            self.client.send(AbortRequests([request_id]))

    def _forget(self, request_id: str) -> bool:
        """Drops the request here; True if it was still live."""
        with self._lock:
            self._sinks.pop(request_id, None)
            return self.output_processor.abort(request_id)

    def fail_all(self, message: str) -> None:
        """Ends every live request with an error (e.g. the server is shutting down)."""
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            for request_id in sinks:
                self.output_processor.abort(request_id)
        if sinks and self.client.alive:
            try:  # a core that is exiting takes no more messages: never wait for it
                self.client.send(AbortRequests(list(sinks)), wait=False)
            except EngineDeadError:
                pass  # it ended meanwhile: nothing left to abort there
        received = self._stats.num_sequences_received  # what the core acknowledged taking
        for sink in sinks.values():
            sink.put(EngineDeadError(message, started=0 < sink.seq <= received))

    def stats(self) -> EngineStats:
        """The engine's load as of its last message (safe from any thread)."""
        return self._stats

    def expert_tokens(self) -> list[tuple[int, list[int]]]:
        """MoE models: tokens routed to each expert of each MoE layer, as last reported."""
        return self._expert_tokens

    def shutdown(self) -> None:
        self.fail_all("engine has shut down")
        self._stopping = True
        self._stop.set()
        if self._reader.is_alive():  # (not started: connect() never returned)
            self._reader.join(timeout=10)
        self.client.shutdown()
        if self._error is None:
            self._error = EngineDeadError("engine has shut down")

    # -- the reader thread: outputs, and restarts of a core that died ---------------------

    def _read_loop(self) -> None:
        while (failure := self._read_until_failure()) is not None:
            if not self._restart(failure):
                return

    def _read_until_failure(self) -> str | None:
        """Delivers the core's outputs until it fails (what failed) or shutdown (None)."""
        client = self.client
        try:
            while not self._stopping:
                message = client.recv(timeout_ms=100)
                if isinstance(message, EngineCoreOutputs):
                    self._deliver(message)
        except EngineDeadError as exc:
            logger.error("%s", exc)
            return str(exc)
        except Exception as exc:  # a bug here must not leave requests hanging
            logger.exception("output processing failed")
            return f"output processing failed: {exc!r}"
        return None

    def _restart(self, failure: str) -> bool:
        """Ends every live request with the failure, then starts a new core (after a
        backoff of 1 s doubling to 30 s, at most `restarts` times in all); True once it is
        ready. With none left, `on_gone()`: the engine stays down."""
        self.restarting = self._restarts_left > 0 and not self._stopping
        suffix = "; the engine is restarting" if self.restarting else ""
        self._error = EngineDeadError(failure + suffix)
        self.fail_all(str(self._error))
        wait, longest = RESTART_BACKOFF_S
        while self._restarts_left > 0 and not self._stopping:
            self._restarts_left -= 1
            self.client.shutdown()  # whatever is left of the one that failed
            if self._stop.wait(wait):
                break
            logger.warning("restarting the engine core (%d restarts left)", self._restarts_left)
            try:
                core = EngineCoreClient(self.client.config)
                ready = core.wait_ready(cancelled=self._stop.is_set)
            except EngineDeadError as exc:
                logger.error("the engine core did not restart: %s", exc)
                wait = min(wait * 2, longest)
                continue
            with self._lock:
                self.client = core
                self._stats = EngineStats(0, 0, 0, 0, ready.num_kv_blocks, 0, 0)
                self._num_sequences_sent = 0  # counted against the new core's
                self.num_restarts += 1
                self.restarting = False
                self._error = None
            logger.warning("engine core restarted (pid %d)", core.process.pid)
            return True
        self.restarting = False
        if not self._stopping:
            logger.error("the engine core is down and no restart is left")
            if self.on_gone is not None:
                self.on_gone()
        return False

    def _deliver(self, message: EngineCoreOutputs) -> None:
        with self._lock:
            outputs, stopped = self.output_processor.process(message.outputs)
            self._stats = message.stats
            if message.stats.expert_tokens is not None:
                self._expert_tokens = message.stats.expert_tokens
            for error in message.errors:
                sink = self._sinks.pop(error.request_id, None)
                self.output_processor.abort(error.request_id)
                if sink is not None:
                    sink.put(ValueError(error.message))
            for output in outputs:
                sink = self._sinks.get(output.request_id)
                if sink is None:
                    continue
                if output.finished:
                    del self._sinks[output.request_id]
                sink.put(output)
        if stopped:
            self.client.send(AbortRequests(stopped))
