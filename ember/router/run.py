"""`ember router`: the token-aware router in front of running workers.

Clients' API key (--api-key, --api-key-file or $EMBER_API_KEY) is checked here; with
$EMBER_CLUSTER_SECRET the router shows its workers the cluster's router token, so workers
that have the secret serve the router alone."""

from __future__ import annotations

import argparse
import logging

from ember import envs
from ember.server.args import add_access_args

logger = logging.getLogger("ember.router")

# how the router moves streams whose worker fails (`migrate.py`), by default; here, so
# that reading the flags imports nothing heavy (`ember serve` reads them first)
DEFAULT_MAX_MIGRATIONS = 2
DEFAULT_STALL_TIMEOUT_S = 30.0


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mixed", action="append", default=[], metavar="URL",
                        help="a mixed (prefill + decode) worker; repeat for more")  # fmt: skip
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="a prefill worker (with --decode: disaggregation)")  # fmt: skip
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="a decode worker (with --prefill: disaggregation)")  # fmt: skip
    parser.add_argument("--discover", action="append", default=[], metavar="dns://NAME:PORT",
                        help="workers at every address NAME resolves to (again every "
                             "--discover-interval s; a Kubernetes headless Service), each "
                             "placed by the role and model its /load reports; repeat for "
                             "more")  # fmt: skip
    parser.add_argument("--discover-interval", type=float, default=5.0, metavar="S",
                        help="seconds between resolutions of each --discover name "
                             "(default 5)")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--health-interval", type=float, default=1.0,
                        help="seconds between health checks of each worker (default 1)")  # fmt: skip
    parser.add_argument("--policy", default="full", choices=["full", "least-load", "round-robin"],
                        help="full: affinity, prefix, least load (default); the others for "
                             "comparisons")  # fmt: skip
    parser.add_argument("--load-factor", type=float, default=1.25,
                        help="a worker over this x the mean load takes no affinity or "
                             "prefix traffic (default 1.25)")  # fmt: skip
    add_migration_args(parser)
    add_access_args(parser)


def add_migration_args(parser: argparse.ArgumentParser) -> None:
    """How the router moves a stream whose worker fails (`ember router`, `ember up`)."""
    parser.add_argument("--max-migrations", type=int, default=DEFAULT_MAX_MIGRATIONS,
                        help="move a stream whose worker fails (or re-send a request) at "
                             f"most this many times (default {DEFAULT_MAX_MIGRATIONS}; "
                             "0: never)")  # fmt: skip
    parser.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S,
                        metavar="S", help="move a stream whose worker sends nothing for S "
                        f"seconds after its first token (default {DEFAULT_STALL_TIMEOUT_S:g}; "
                        "0: never)")  # fmt: skip


def migration_of(args: argparse.Namespace):
    """The `Migration` the flags ask for."""
    from ember.router.migrate import Migration

    return Migration(args.max_migrations, args.stall_timeout or None)


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from ember.router.app import build_router_app
    from ember.router.members import DnsTarget, check_url
    from ember.router.policy import Pools
    from ember.server.args import access_of
    from ember.server.http_protocol import uvicorn_options

    if bool(args.prefill) != bool(args.decode):
        raise ValueError("--prefill and --decode: disaggregation needs workers of both kinds")
    if args.load_factor < 1:
        raise ValueError("--load-factor must be >= 1")
    if args.discover_interval <= 0:
        raise ValueError("--discover-interval must be > 0")
    discover = tuple(DnsTarget.parse(spec) for spec in args.discover)
    for flag in ("mixed", "prefill", "decode"):
        for url in getattr(args, flag):
            check_url(url, f"--{flag}")
    secret = envs.cluster_secret()
    if not (args.mixed or args.prefill or discover or secret):
        raise ValueError("give the workers: --mixed URL (or --prefill and --decode URLs), "
                         "--discover dns://NAME:PORT, or $EMBER_CLUSTER_SECRET for workers "
                         "that register themselves")  # fmt: skip
    pools = Pools.from_urls(args.mixed, args.prefill, args.decode, args.load_factor, args.policy)
    access = access_of(args)  # what clients show; workers see the router's token instead
    if secret is None and args.max_migrations:
        logger.warning("streams are not moved when a worker fails: that needs the workers "
                       "and the router to share $EMBER_CLUSTER_SECRET")  # fmt: skip
    app = build_router_app(pools, args.health_interval, access, secret, migration_of(args),
                           discover, args.discover_interval)  # fmt: skip
    logger.info("routing http://%s:%d -> mixed %s, prefill %s, decode %s, discover %s%s",
                args.host, args.port, args.mixed, args.prefill, args.decode, args.discover,
                ", registration open to the cluster" if secret else "")  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=False,
                **uvicorn_options(args.read_timeout, args.max_connections))  # fmt: skip
    return 0
