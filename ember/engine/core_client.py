"""The frontend's handle on an engine core process: start it, send it messages, read back.

Life cycle: `EngineCoreClient(config)` binds two ipc sockets in a private temporary
directory (named with its pid, so that the next frontend can remove those of killed ones)
and starts `python -m ember.engine.core_proc`; `wait_ready()` waits for
`EngineReady` (raising `EngineDeadError` with the core's message if loading failed). `send()` may be
called from any thread (a lock guards the socket); `recv()` is for one reader thread.
`shutdown()` asks the core to stop, waits, kills it if it must, and removes the sockets.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from ember import envs
from ember.config import EngineConfig
from ember.engine.messages import EngineFailed, EngineInput, EngineOutput, EngineReady, Shutdown

logger = logging.getLogger("ember.engine")


SOCKET_DIR_PREFIX = "ember-core-"  # then the frontend's pid: ember-core-1234-abcd1234


def remove_stale_socket_dirs(directory: str | None = None) -> list[str]:
    """Removes the socket directories of frontends that are gone (killed before they could);
    returns their paths."""
    directory = directory or tempfile.gettempdir()
    removed = []
    for name in os.listdir(directory):
        match = re.fullmatch(rf"{SOCKET_DIR_PREFIX}(\d+)-\w+", name)
        if match and not _pid_alive(int(match.group(1))):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            removed.append(os.path.join(directory, name))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class EngineDeadError(RuntimeError):
    """The engine core has stopped; no request can be served. `started`: whether the core
    had taken the request it fails (False: it never saw it, so another engine may run it)."""

    def __init__(self, message: str, started: bool = True) -> None:
        super().__init__(message)
        self.started = started


class EngineCoreClient:
    """`EngineCoreClient(config)` starts a core on `config`; `EngineCoreClient(None)` starts
    one before the config is known (`ember serve` does, before it reads its flags: the
    core's imports are most of a start), and `start(config)` hands it over later."""

    def __init__(self, config: EngineConfig | None, startup_timeout: float = 600.0) -> None:
        self.config = config
        remove_stale_socket_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
        self._input.bind(f"ipc://{self._dir}/input")
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(f"ipc://{self._dir}/output")
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineOutput)
        self._closed = False
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ember.engine.core_proc",
                "--config",
                "-" if config is None else msgspec.json.encode(config).decode(),
                "--input",
                f"ipc://{self._dir}/input",
                "--output",
                f"ipc://{self._dir}/output",
            ],
            env=envs.engine_core_env(),
            stdin=subprocess.PIPE if config is None else None,
        )
        atexit.register(self.shutdown)
        self._startup_timeout = startup_timeout
        self._ready: EngineReady | None = None

    def start(self, config: EngineConfig) -> None:
        """Hands a core started without a config its config (on its standard input, which
        it reads once its imports are done)."""
        if self.config is not None:
            raise RuntimeError("this engine core has its config already")
        self.config = config
        try:
            self.process.stdin.write(msgspec.json.encode(config) + b"\n")
            self.process.stdin.close()
        except OSError:  # the core is gone: wait_ready() says so
            logger.debug("engine core took no config", exc_info=True)

    @property
    def alive(self) -> bool:
        return not self._closed and self.process.poll() is None

    def wait_ready(self, cancelled: Callable[[], bool] | None = None) -> EngineReady:
        """Blocks until the core has loaded the model (the frontend does its own loading
        meanwhile); EngineDeadError if it fails, takes longer than startup_timeout, or
        `cancelled()` turns true meanwhile (the core is then stopped)."""
        if self._ready is None:
            try:
                self._ready = self._wait_ready(self._startup_timeout, cancelled)
            except BaseException:
                self.shutdown()
                raise
        return self._ready

    @property
    def ready(self) -> EngineReady:
        return self.wait_ready()

    def _wait_ready(self, timeout: float, cancelled: Callable[[], bool] | None) -> EngineReady:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cancelled is not None and cancelled():
                raise EngineDeadError("engine core start cancelled")
            message = self.recv(timeout_ms=200)
            if isinstance(message, EngineReady):
                logger.info("engine core ready (pid %d)", self.process.pid)
                return message
        raise EngineDeadError(f"engine core did not start within {timeout:.0f} s")

    def send(self, message: EngineInput, wait: bool = True) -> None:
        """`wait=False`: dropped if the core is not there to take it (a core that is
        exiting has closed its socket, and a send to no peer would block)."""
        if not self.alive:
            raise EngineDeadError("engine core is not running", started=False)
        with self._send_lock:
            if self._closed:  # shut down meanwhile (a restart replaces a failed core)
                raise EngineDeadError("engine core is not running", started=False)
            try:
                self._input.send(self._encoder.encode(message), 0 if wait else zmq.NOBLOCK)
            except zmq.Again:
                pass

    def recv(self, timeout_ms: int) -> EngineOutput | None:
        """The next message, or None after timeout_ms; EngineDeadError once the core is
        gone and nothing is left to read."""
        if self._output.poll(timeout_ms):
            message = self._decoder.decode(self._output.recv(copy=False).buffer)
            if isinstance(message, EngineFailed):
                raise EngineDeadError(f"engine core failed: {message.message}")
            return message
        if not self.alive:
            code = self.process.poll()
            raise EngineDeadError(f"engine core exited (code {code})")
        return None

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        if self.config is None:  # never given a config: nothing of it to wind down
            self.process.kill()
        if self.process.poll() is None:
            try:
                with self._send_lock:
                    self._input.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
                self.process.wait(timeout)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        with self._send_lock:  # no send is halfway through when the socket closes
            self._closed = True
            self._input.close(linger=0)
        atexit.unregister(self.shutdown)
        self._output.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
