"""The router's view of its workers: the fleet and its pools (`members.py`), the decisions
taken, the cluster's cache hit ratio, and their Prometheus series. A health loop polls
every worker's /load each `health_interval` seconds (with the router's token, all workers
at once): a worker that fails is out of its pool, one that answers again comes back, and
what each says of its role and model places it. A discovery loop per `--discover` target
resolves its name again every `discover_interval` seconds."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict

import httpx
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as PromCounter

from ember import cluster
from ember.headers import ROUTER_TOKEN_HEADER
from ember.router.members import DEFAULT_DISCOVER_INTERVAL_S, ROLES, DnsTarget, Fleet
from ember.router.migrate import Migration
from ember.router.policy import Decision, Pools, Worker
from ember.server.errors import TOO_MANY_CONNECTIONS, error_code_of

logger = logging.getLogger("ember.router")

MAX_RESPONSE_HOMES = 100_000
HEALTH_TIMEOUT_S = 2.0  # a health check answered later than this is a miss
HEALTH_MISSES = 3  # misses in a row (too busy to answer) that take a worker out


class RouterState:
    def __init__(
        self,
        fleet: Fleet | Pools,
        health_interval: float,
        cluster_secret: bytes | None = None,
        migration: Migration | None = None,
        discover: tuple[DnsTarget, ...] = (),
        discover_interval: float = DEFAULT_DISCOVER_INTERVAL_S,
    ) -> None:
        self.fleet = fleet if isinstance(fleet, Fleet) else Fleet.of(fleet)
        self.discover, self.discover_interval = discover, discover_interval
        self.health_interval = health_interval
        self.cluster_secret = cluster_secret
        self.migration = migration or Migration()
        # what the router shows its workers: its token, when it has the cluster secret
        self.worker_headers = (
            {ROUTER_TOKEN_HEADER: cluster.router_token(cluster_secret)} if cluster_secret else {}
        )
        self.response_homes: OrderedDict[str, str] = OrderedDict()  # response id -> worker
        self.not_workers: set[str] = set()  # URLs whose /load is no worker's (logged once)
        self.decisions: Counter = Counter()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        # to the workers: as many connections as requests in flight (the router's own
        # --max-connections bounds those), none waiting for another's; health checks on a
        # client of their own, so that they never queue behind the traffic
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=limits)
        self.health_client = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S)
        self.registry = CollectorRegistry()
        self.decision_counter = PromCounter(
            "ember_router_decisions", "Routing decisions by pool and reason.",
            ["pool", "reason"], registry=self.registry,
        )  # fmt: skip
        self.worker_load = Gauge(
            "ember_router_worker_tokens_in_flight", "Tokens in flight per worker.",
            ["worker", "pool"], registry=self.registry,
        )  # fmt: skip
        self.num_workers = Gauge(
            "ember_router_workers", "Workers by model, role and status (up, down, draining).",
            ["model", "role", "status"], registry=self.registry,
        )  # fmt: skip
        self.hit_ratio = Gauge(
            "ember_router_cache_hit_ratio", "Cached / prompt tokens over all responses.",
            registry=self.registry,
        )  # fmt: skip

    def record_usage(self, usage: dict | None) -> None:
        """Counts a response's usage, OpenAI's or Anthropic's (whose input_tokens leave
        out the cached ones)."""
        if not usage:
            return
        if "input_tokens" in usage:
            cached = usage.get("cache_read_input_tokens") or 0
            self.prompt_tokens += (usage.get("input_tokens") or 0) + cached
            self.cached_tokens += cached
            return
        self.prompt_tokens += usage.get("prompt_tokens") or 0
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens += details.get("cached_tokens") or 0

    def remember_response(self, response_id: str, worker_url: str) -> None:
        """A /v1/responses id and the worker that stored it (later turns go there)."""
        self.response_homes[response_id] = worker_url
        while len(self.response_homes) > MAX_RESPONSE_HOMES:
            self.response_homes.popitem(last=False)

    def decide(self, decision: Decision, pool: str) -> None:
        key = decision.reason if pool == "mixed" else f"{pool}:{decision.reason}"
        self.decisions[key] += 1
        self.decision_counter.labels(pool, decision.reason).inc()

    async def check_health(self) -> None:
        """Every worker's /load, all at once (draining ones are left alone); then the
        drained workers with nothing left in flight are forgotten."""
        workers = [w for w in self.fleet.workers.values() if not w.draining]
        await asyncio.gather(*(self.check_worker(w) for w in workers))
        self.fleet.sweep()

    async def check_worker(self, worker: Worker) -> None:
        """One worker's /load. It is down when it cannot be reached, or says it is (its
        engine is gone or restarting); one that answers too late, or refuses the check at
        its connection limit, is busy, and down only after HEALTH_MISSES such checks in a
        row (overload must not empty the pools). Its report says its role and model."""
        report, busy = {}, False
        try:
            response = await self.health_client.get(
                f"{worker.url}/load", headers=self.worker_headers
            )
            if response.status_code == 200:
                report = response.json()
            else:
                code = error_code_of(response.content, response.headers)
                busy = code == TOO_MANY_CONNECTIONS
        except httpx.TimeoutException:
            busy = True
        except (httpx.HTTPError, ValueError):
            pass
        if not isinstance(report, dict):
            report = {}
        if busy:
            worker.missed_checks += 1
            ok = worker.healthy and worker.missed_checks < HEALTH_MISSES
        else:
            worker.missed_checks = 0
            ok = bool(report) and report.get("healthy", True)
            if ok and worker.source != "static" and report.get("role") not in ROLES:
                # not an ember worker (another router: requests would go round in a loop)
                ok = False
                if worker.url not in self.not_workers:
                    self.not_workers.add(worker.url)
                    logger.warning("%s does not report a worker's role: not used", worker.url)
            worker.reported = report if ok else {}
            if ok and worker.url in self.fleet.workers:
                self.fleet.learn(worker, report)
        if ok != worker.healthy:
            logger.log(logging.INFO if ok else logging.WARNING,
                       "worker %s is %s", worker.url, "up" if ok else "down")  # fmt: skip
        worker.healthy = ok

    async def health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.health_interval)

    async def discover_once(self) -> None:
        """Each --discover target resolved; new workers checked at once."""
        for target in self.discover:
            urls = await target.resolve()
            if urls is not None:
                self.fleet.discovered(target, urls)
        fresh = [w for w in self.fleet.workers.values() if not w.draining and not w.reported]
        await asyncio.gather(*(self.check_worker(w) for w in fresh))

    async def discover_loop(self) -> None:
        while True:
            await asyncio.sleep(self.discover_interval)
            await self.discover_once()
