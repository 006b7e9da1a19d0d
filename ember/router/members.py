"""Who the router's workers are, and which model and role each one serves.

Workers join in three ways, any mix of them at once:
- the static flags (`--mixed`, `--prefill`, `--decode URL`), each with its role;
- DNS discovery (`--discover dns://NAME:PORT`): NAME is resolved again every `--discover-interval` seconds and each address it gives is a
  worker at `http://ADDRESS:PORT` (a Kubernetes headless Service names its ready pods);
- registration (`POST /workers`, authenticated with the cluster's member token;
  `ember serve --register ROUTER` does it for a worker, and again every few seconds, so
  a restarted router learns its workers back).
A worker's /load says its role and the model it serves. The fleet keeps one `Pools` per
model: a request's `model` picks the pool (with a single model, every request goes to
it, and the worker checks the name). A worker is placed once its model is known (a
static worker at once, under the model it later reports).

A worker leaves by draining: gone from DNS, `DELETE /workers/{id}`, or `ember serve`
stopping. A draining worker takes no new request; those it has finish (a stream whose
worker then stops moves to another: `migrate.py`); it is forgotten once it has none.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from ember.router.policy import Pools, Worker

logger = logging.getLogger("ember.router")

ROLES = ("mixed", "prefill", "decode")
MAX_WORKERS = (
    4096  # a registration past this is refused (each worker's prefix table is ~38 MB at most)
)
MAX_URL_CHARS = 2048
RESOLVE_TIMEOUT_S = 5.0
DEFAULT_DISCOVER_INTERVAL_S = 5.0


def check_url(url: object, name: str = "url") -> str:
    """A worker's base URL (`http(s)://HOST:PORT`, nothing after it), or a ValueError
    naming `name`."""
    if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS:
        raise ValueError(f"{name} must be a URL string of at most {MAX_URL_CHARS} characters")
    try:
        parts = urlsplit(url.rstrip("/"))
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{name} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{name} must be http://HOST:PORT or https://HOST:PORT; got {url!r}")
    if parts.path or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{name} must name a worker's address only (no path, query or user)")
    if port is None:
        raise ValueError(f"{name} must give the worker's port; got {url!r}")
    return url.rstrip("/")


def check_role(role: object, name: str = "role") -> str | None:
    if role is None or role in ROLES:
        return role
    raise ValueError(f"{name} must be one of {', '.join(ROLES)}; got {role!r}")


def address_url(address: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://[{address}]:{port}" if ":" in address else f"{scheme}://{address}:{port}"


@dataclass(frozen=True)
class DnsTarget:
    """`dns://NAME:PORT`: the workers NAME resolves to, on PORT (each says its role and
    model at /load)."""

    spec: str
    name: str
    port: int

    @classmethod
    def parse(cls, spec: str) -> DnsTarget:
        parts = urlsplit(spec)
        try:
            port = parts.port
        except ValueError:
            port = None
        extra = parts.path or parts.query or parts.fragment or parts.username
        if parts.scheme != "dns" or not parts.hostname or port is None or extra:
            raise ValueError(f"--discover must be dns://NAME:PORT; got {spec!r}")
        return cls(spec, parts.hostname, port)

    async def resolve(self) -> set[str] | None:
        """The worker URLs NAME gives now; empty when the name does not exist (a headless
        Service with no ready pod), None when the resolver failed (a DNS outage must not
        drain the fleet)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                infos = await loop.getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            gone = (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME))
            if exc.errno in gone:
                return set()
            logger.warning("could not resolve %s (%s); keeping its workers", self.name, exc)
            return None
        except (TimeoutError, OSError) as exc:
            logger.warning("could not resolve %s (%r); keeping its workers", self.name, exc)
            return None
        return {address_url(info[4][0], self.port) for info in infos}


class Fleet:
    """Every worker the router knows (members and those draining), and the pools of each
    model."""

    def __init__(self, load_factor: float = 1.25, policy: str = "full") -> None:
        self.load_factor, self.policy = load_factor, policy
        self.workers: dict[str, Worker] = {}  # by URL
        self.models: dict[str | None, Pools] = {}  # None: static workers not heard from yet
        self._placed: dict[Worker, str | None] = {}  # worker -> the model key it sits under

    @classmethod
    def of(cls, pools: Pools) -> Fleet:
        """A fleet of static workers (their model learnt from their first /load)."""
        fleet = cls(pools.load_factor, pools.policy)
        if pools.workers:
            fleet.models[None] = pools
        for worker in pools.workers:
            fleet.workers[worker.url] = worker
            fleet._placed[worker] = None
        return fleet

    def add(self, url: str, role: str | None = None, source: str = "register") -> Worker:
        """The worker at `url`, joining (or staying, or coming back from draining). One
        whose role is not given is mixed until its /load says otherwise; it is placed in a
        pool once its /load has said which model it serves."""
        worker = self.workers.get(url)
        if worker is None:
            if len(self.workers) >= MAX_WORKERS:
                raise ValueError(f"the router already has {MAX_WORKERS} workers")
            worker = Worker(url, role or "mixed", healthy=False, source=source)
            self.workers[url] = worker
            logger.info("worker %s joins (%s)", url, source)
        elif worker.draining:
            logger.info("worker %s is back (%s)", url, source)
            worker.draining, worker.source = False, source
        if role is not None and role != worker.kind:
            if worker in self._placed:
                self._place(worker, worker.model, role)
            worker.kind = role
        return worker

    def learn(self, worker: Worker, report: dict) -> None:
        """What a worker's /load says of itself: its model, and (unless a static flag gave
        it) its role."""
        role = report.get("role") if report.get("role") in ROLES else worker.kind
        if worker.source == "static" and role != worker.kind:
            logger.warning("worker %s says it is a %s worker; it was given as %s",
                           worker.url, role, worker.kind)  # fmt: skip
            role = worker.kind
        model = report.get("model") if isinstance(report.get("model"), str) else None
        if worker not in self._placed or (model, role) != (self._placed[worker], worker.kind):
            self._place(worker, model, role)

    def _place(self, worker: Worker, model: str | None, role: str) -> None:
        if worker in self._placed:
            self._unplace(worker)
        worker.model, worker.kind = model, role
        if worker.url not in self.workers:
            return
        pools = self.models.get(model)
        if pools is None:
            pools = self.models[model] = Pools(load_factor=self.load_factor, policy=self.policy)
        pools.add(worker)
        self._placed[worker] = model

    def _unplace(self, worker: Worker) -> None:
        model = self._placed.pop(worker)
        pools = self.models.get(model)
        if pools is not None:
            pools.remove(worker)
            if not pools.workers:
                del self.models[model]

    def drain(self, worker: Worker, why: str) -> None:
        if not worker.draining:
            logger.info("worker %s drains (%s): %d requests in flight",
                        worker.url, why, worker.requests_in_flight)  # fmt: skip
        worker.draining = True
        self.sweep()

    def sweep(self) -> None:
        """Forgets the drained workers that have no request left."""
        for worker in list(self.workers.values()):
            if worker.draining and worker.requests_in_flight == 0:
                if worker in self._placed:
                    self._unplace(worker)
                del self.workers[worker.url]
                logger.info("worker %s has left", worker.url)

    def discovered(self, target: DnsTarget, urls: set[str]) -> None:
        """A resolution of `target`: new addresses join, those gone drain."""
        for url in sorted(urls):
            worker = self.workers.get(url)
            if worker is None or worker.draining or worker.source == target.spec:
                self.add(url, None, target.spec)
        for worker in list(self.workers.values()):
            if worker.source == target.spec and worker.url not in urls:
                self.drain(worker, f"no longer in {target.spec}")

    def find(self, worker_id: str) -> Worker | None:
        return next((w for w in self.workers.values() if w.id == worker_id), None)

    def pools_for(self, model: object) -> Pools | None:
        """The pools of the model a request names: with one model, that one whatever it
        names (its workers answer a wrong name with a 404 of their own); None when no
        pool serves it (or there are no workers at all)."""
        if isinstance(model, str) and model in self.models:
            return self.models[model]
        if len(self.models) == 1:
            return next(iter(self.models.values()))
        return None

    def healthy(self) -> list[Worker]:
        """Placed workers that may take requests."""
        return [w for pools in self.models.values() for w in pools.healthy()]

    def model_names(self) -> list[str]:
        return sorted(m for m in self.models if m is not None)
