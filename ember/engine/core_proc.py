"""The engine core in its own process, driven over ZeroMQ with msgspec messages.

Life cycle: a frontend (`EngineCoreClient`) binds two ipc sockets and starts
`python -m ember.engine.core_proc --config JSON --input ADDR --output ADDR`. The process
loads the model and sends `EngineReady` (or `EngineFailed`, then exits 1). Then it loops:
take every waiting input message (blocking while there is no work, so an idle engine
costs no CPU), acknowledge new requests (stats whose `num_sequences_received` counts
them, sent before the step: a frontend that then loses the core knows which requests it
had taken), run one step, send its outputs with the engine's stats. `Shutdown`, the
parent's death or SIGTERM end the loop; what is still running is aborted.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import math
import os
import signal
import sys

import msgspec
import zmq

from ember import envs, startup
from ember.config import EngineConfig
from ember.engine.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFailed,
    EngineInput,
    EngineReady,
    Preparing,
    RequestError,
    Shutdown,
)

logger = logging.getLogger("ember.engine")

IDLE_POLL_MS = 1000  # how often an idle engine checks that its parent is still there
KV_POLL_MS = 2  # how often an engine with KV on its way (or held for others) looks again


class EngineCoreProc:
    def __init__(self, core, input_socket: zmq.Socket, output_socket: zmq.Socket) -> None:
        self.core = core
        self.input = input_socket
        self.output = output_socket
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.encoder = msgspec.msgpack.Encoder()
        self.stopping = False

    def run(self, parent_pid: int) -> None:
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        core = self.core
        last_state = None
        acknowledged = core.num_sequences_received
        while not self.stopping:
            busy = core.has_runnable()
            hold_ms = core.hold_ms() if busy else 0.0  # for requests the frontend prepares
            pending = core.has_unfinished() or core.holds_kv()  # KV arriving or held
            spare = not busy and not pending and core.has_idle_work()
            timeout = 0 if busy or spare else KV_POLL_MS if pending else IDLE_POLL_MS
            if hold_ms:
                timeout = math.ceil(hold_ms)
            received = bool(poller.poll(timeout))
            if not received and not pending and os.getppid() != parent_pid:
                logger.warning("frontend process is gone; engine core exits")
                break
            errors = self._drain_inputs() if received else []
            if core.num_sequences_received != acknowledged:
                self._send(EngineCoreOutputs([], core.stats(), errors))
                acknowledged, errors = core.num_sequences_received, []
            stepping = (core.has_unfinished() or core.holds_kv()) and not core.hold_ms()
            outputs = core.step() if stepping else []
            if spare and not received:
                core.idle_work()  # KV pages ahead of use, a few ms at a time
            state = (core.kv_cache.num_free_blocks, core.connector.num_loading, core.tier_writes())
            if outputs or received or busy or state != last_state:  # stats go out on changes
                self._send(EngineCoreOutputs(outputs, core.stats(), errors))
                last_state = state
        for request_id in list(self.core.scheduler.requests):
            self.core.abort_requests([request_id])

    def _drain_inputs(self) -> list[RequestError]:
        errors = []
        while True:
            try:
                frame = self.input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return errors
            message = self.decoder.decode(frame.buffer)
            if isinstance(message, EngineCoreRequest):
                try:
                    self.core.add_request(message)
                except ValueError as exc:
                    errors.append(RequestError(message.request_id, str(exc)))
                except Exception as exc:  # a request the core cannot take must not stop it
                    logger.exception("request %s refused", message.request_id)
                    errors.append(RequestError(message.request_id, f"{type(exc).__name__}: {exc}"))
            elif isinstance(message, AbortRequests):
                self.core.abort_requests(message.request_ids)
            elif isinstance(message, Preparing):
                self.core.num_preparing = message.num_requests
            elif isinstance(message, Shutdown):
                self.stopping = True

    def _send(self, message) -> None:
        self.output.send(self.encoder.encode(message), copy=False)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Asks Linux to send this process `sig` when its parent dies (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def main(argv: list[str] | None = None) -> int:
    startup.hold_collector()  # until the model is loaded
    parser = argparse.ArgumentParser(prog="ember-engine-core")
    parser.add_argument(
        "--config",
        required=True,
        help="EngineConfig as JSON; '-': a line of standard input, read after the imports "
        "(a core started before its frontend had read its flags)",
    )
    parser.add_argument("--input", required=True, help="zmq address to pull requests from")
    parser.add_argument("--output", required=True, help="zmq address to push outputs to")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=envs.log_level(), format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s"
    )
    parent_pid = os.getppid()
    die_with_parent()
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    input_socket.connect(args.input)
    output_socket = context.socket(zmq.PUSH)
    output_socket.connect(args.output)
    encoder = msgspec.msgpack.Encoder()
    proc = None
    try:
        from ember.engine.core import EngineCore

        startup.mark("imports")
        text = sys.stdin.buffer.readline() if args.config == "-" else args.config.encode()
        if not text.strip():  # the frontend stopped before it had a config to give
            return 0
        config = msgspec.json.decode(text, type=EngineConfig)
        core = EngineCore.from_config(config)
        proc = EngineCoreProc(core, input_socket, output_socket)
        signal.signal(signal.SIGTERM, lambda *_: setattr(proc, "stopping", True))
        startup.release_collector()
        startup.mark("ready")
        ready = EngineReady(core.max_model_len, core.kv_cache.num_blocks, startup.marks())
        output_socket.send(encoder.encode(ready))
        try:
            proc.run(parent_pid)
        finally:
            core.close()
        return 0
    except Exception as exc:
        logger.exception("engine core failed")
        output_socket.send(encoder.encode(EngineFailed(f"{type(exc).__name__}: {exc}")))
        return 1
    finally:
        output_socket.close(linger=1000)
        input_socket.close(linger=0)
        context.term()


if __name__ == "__main__":
    sys.exit(main())
