"""The flags of `ember serve` (and those `ember router` and `ember up` share with it).

Light on purpose: `ember serve` parses these and starts its engine core before it
imports the HTTP stack (FastAPI, uvicorn), so nothing here may import that stack.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ember import envs
from ember.server.limits import (
    DEFAULT_ENGINE_RESTARTS,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_STORE_CHARS,
)
from ember.units import parse_bytes

if TYPE_CHECKING:
    from ember.server.guard import Access


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: smollm2-135m, or MODEL as given)",
    )
    add_access_args(parser)
    add_queue_args(parser)
    add_parser_args(parser)
    parser.add_argument(
        "--response-store-size",
        type=parse_bytes,
        default=DEFAULT_STORE_CHARS,
        help="characters of conversation /v1/responses keeps for previous_response_id; the "
        "oldest responses go first (default 64M)",
    )
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    parser.add_argument(
        "--register",
        default=None,
        metavar="ROUTER_URL",
        help="join this router (POST /workers, again every 10 s; needs $EMBER_CLUSTER_SECRET) "
        "and leave it when stopping (it drains this worker)",
    )
    parser.add_argument(
        "--advertise-url",
        default=None,
        metavar="URL",
        help="with --register: the URL the router reaches this worker at (default "
        "http://HOST:PORT of --host and --port)",
    )


def add_access_args(parser: argparse.ArgumentParser) -> None:
    """Who may call and how much they may send (`ember serve`, `ember router`, `ember up`)."""
    parser.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize (visible to "
        "other users in `ps`: prefer $EMBER_API_KEY or --api-key-file)",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        help="read the API keys from this file, one a line; with several, each key is a "
        "tenant whose prefix cache is its own",
    )
    parser.add_argument(
        "--shared-prefix-cache",
        action="store_true",
        help="with several API keys, let their requests share prefix-cache blocks (and "
        "so learn from their timing what others sent; default: each key's are apart)",
    )
    parser.add_argument(
        "--protect-metrics",
        action="store_true",
        help="/load and /metrics need the API key too (or, on a worker, its router's token)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=parse_bytes,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="refuse larger request bodies with 413 before reading them (default 4M)",
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=DEFAULT_READ_TIMEOUT_S,
        metavar="S",
        help="a request's head must come within S seconds of its first byte, then its body "
        f"within S more, else 408 (slow clients hold no connection; default "
        f"{DEFAULT_READ_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="connections and requests at once; more are answered 503 at once (default "
        f"{DEFAULT_MAX_CONNECTIONS})",
    )


def add_queue_args(parser: argparse.ArgumentParser) -> None:
    """A worker's admission and shutdown (`ember serve`, `ember up` for its workers)."""
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=DEFAULT_MAX_QUEUED_REQUESTS,
        help="answer 429 (with Retry-After) while this many sequences wait for the engine "
        f"(default {DEFAULT_MAX_QUEUED_REQUESTS})",
    )
    parser.add_argument(
        "--engine-restarts",
        type=int,
        default=DEFAULT_ENGINE_RESTARTS,
        help="start an engine core that dies again, at most this many times (backoff 1 s "
        f"doubling to 30 s; default {DEFAULT_ENGINE_RESTARTS}); with none left the server "
        "exits (code 1)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds in-flight requests get to finish on SIGTERM/SIGINT (default 5)",
    )


def add_parser_args(parser: argparse.ArgumentParser) -> None:
    """The model's tool-call and reasoning formats (`ember serve`, `ember up`)."""
    from ember.server.parsers import AUTO, NONE, REASONING_PARSERS, TOOL_PARSERS

    def known(registry, *extra):
        def check(name: str) -> str:
            if name in extra or name in registry:
                return name
            names = ", ".join([*extra, *registry.names()])
            raise argparse.ArgumentTypeError(f"unknown {registry.kind} {name!r}; known: {names}")

        return check

    parser.add_argument(
        "--tool-call-parser",
        type=known(TOOL_PARSERS, AUTO),
        default=AUTO,
        help=f"the model's tool-call format: {', '.join(TOOL_PARSERS.names())} "
        "(default auto: read from the chat template, else hermes)",
    )
    parser.add_argument(
        "--reasoning-parser",
        type=known(REASONING_PARSERS, AUTO, NONE),
        default=AUTO,
        help=f"the model's reasoning format: {', '.join(REASONING_PARSERS.names())}, or none "
        "(default auto: from the chat template's <think> markers)",
    )


def resolve_api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key, else every line of --api-key-file (one key a line: a tenant each), else
    $EMBER_API_KEY; none: no key needed."""
    if args.api_key:
        return (args.api_key,)
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as file:
            keys = tuple(dict.fromkeys(line.strip() for line in file if line.strip()))
        if not keys:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key")
        return keys
    key = envs.api_key()
    return (key,) if key else ()


def access_of(args: argparse.Namespace, cluster_secret: bytes | None = None) -> Access:
    from ember.server.guard import Access

    if args.max_request_bytes < 1:
        raise ValueError("--max-request-bytes must be >= 1")
    if args.read_timeout <= 0 or args.max_connections < 1:
        raise ValueError("--read-timeout must be > 0 and --max-connections >= 1")
    return Access(
        api_keys=resolve_api_keys(args),
        cluster_secret=cluster_secret,
        protect_metrics=args.protect_metrics,
        max_request_bytes=args.max_request_bytes,
        read_timeout=args.read_timeout,
        key_salts=not args.shared_prefix_cache,
    )


def check_serve_args(args: argparse.Namespace) -> None:
    """The ValueErrors `ember serve` would meet later, raised before its core starts."""
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise ValueError("--max-queued-requests must be >= 0")
    if args.max_request_bytes < 1:
        raise ValueError("--max-request-bytes must be >= 1")
    if args.engine_restarts < 0:
        raise ValueError("--engine-restarts must be >= 0")
    resolve_api_keys(args)
