"""The HTTP half of `ember serve`: the frontend (`AsyncLLM`) on an engine core that is
already starting, the FastAPI app, and uvicorn with ember's shutdown.

Shutdown (SIGINT / SIGTERM): uvicorn stops accepting connections; requests in flight get
`--shutdown-timeout` seconds to finish, then each still running is ended with an error
("server is shutting down"), and the engine core process is stopped. Nothing is left
running.

An engine core that dies is started again (`--engine-restarts`, `AsyncLLM`): requests in
flight end with an error event, /health answers 503 while the core restarts and 200 once
it is ready. With no restart left the server exits with code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import signal
import threading
from collections.abc import Callable

import uvicorn

from ember import envs, startup
from ember.engine.async_llm import AsyncLLM
from ember.engine.core_client import EngineCoreClient
from ember.server.app import build_app
from ember.server.args import access_of
from ember.server.http_protocol import uvicorn_options
from ember.server.metrics import ServerMetrics
from ember.server.parsers import resolve_parsers
from ember.server.register import Registration, advertised_url

logger = logging.getLogger("ember.server")

DEFAULT_MODEL_NAME = "smollm2-135m"


def run_http(args: argparse.Namespace, core: EngineCoreClient) -> int:
    """Serves until SIGINT / SIGTERM; stops the core before it returns."""
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    access = access_of(args, envs.cluster_secret())
    registration = None
    if args.register:  # checked before the frontend starts
        url = advertised_url(args.host, args.port, args.advertise_url)
        registration = Registration(args.register, url, args.role, envs.cluster_secret())
    llm = AsyncLLM(core=core, restarts=args.engine_restarts, wait=False)
    try:
        parsers = resolve_parsers(llm.tokenizer, args.tool_call_parser, args.reasoning_parser)
        logger.info("tool-call parser %s, reasoning parser %s", parsers.tool, parsers.reasoning)
        app = build_app(
            llm, name, access, args.max_queued_requests, parsers, args.response_store_size
        )
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            access_log=args.access_log,
            log_level="info",
            timeout_graceful_shutdown=int(args.shutdown_timeout) + 5,
            **uvicorn_options(args.read_timeout, args.max_connections),
        )
        config.load()  # (its protocol classes imported) while the core still loads
        llm.connect()
        started = functools.partial(_started, app.state.metrics, llm.core_startup, registration)
        server = _Server(config, llm, args.shutdown_timeout, started, registration)
        llm.on_gone = server.engine_gone
        logger.info("serving %s on http://%s:%d", name, args.host, args.port)
        server.run()
    finally:
        llm.shutdown()
        if registration is not None:
            registration.leave_soon().join(5.0)
    return 1 if server.gone else 0


def _started(metrics: ServerMetrics, core_marks: list[startup.Mark], registration) -> None:
    startup.release_collector()
    _report_startup(metrics, core_marks)
    if registration is not None:
        registration.start()


def _report_startup(metrics: ServerMetrics, core_marks: list[startup.Mark]) -> None:
    """Both processes' start-up phases, as seconds since this process began: one log line
    and `ember_startup_seconds` in /metrics."""
    startup.mark("http")
    api = startup.marks()
    origin = api[0][1]
    processes = {"api": startup.relative(api, origin), "core": startup.relative(core_marks, origin)}
    metrics.set_startup(processes)
    logger.info("started in %.2f s (%s)", processes["api"][-1][1], startup.summary(processes))


class _Server(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        llm,
        shutdown_timeout: float,
        started: Callable[[], None],
        registration: Registration | None = None,
    ) -> None:
        super().__init__(config)
        self.llm = llm
        self.registration = registration
        self.shutdown_timeout = shutdown_timeout
        self.started_callback = started
        self.loop: asyncio.AbstractEventLoop | None = None
        self.gone = False  # the engine core died and no restart was left: exit with 1

    def engine_gone(self) -> None:
        """(From the frontend's reader thread.) Stops serving: a supervisor (ember up,
        Kubernetes) starts the worker again."""
        self.gone = True
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's own version re-raises the signal after shutting down, which would kill
        the process before the engine core is stopped; this one just restores handlers."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:  # listening (uvicorn leaves it False when it could not bind)
            self.started_callback()

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit and self.registration is not None:  # the router drains us
            self.registration.leave_soon()
        if not self.should_exit and self.loop is not None:
            logger.info("shutting down; in-flight requests have %.0f s", self.shutdown_timeout)
            self.loop.call_soon_threadsafe(
                self.loop.call_later,
                self.shutdown_timeout,
                self.llm.fail_all,
                "server is shutting down",
            )
        super().handle_exit(sig, frame)
