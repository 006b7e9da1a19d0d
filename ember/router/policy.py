"""Where a request goes: session affinity, then cached prefix, then least load by tokens.

The router never sees token ids, so it measures prompts in approximate tokens (characters
/ 4) and remembers, per worker, the chained hashes of the prompts' 64-character chunks
it sent there (an approximate prefix tree, as a bounded LRU set). Load is the router's
own count of tokens in flight on each worker (uncached prompt tokens + max output),
released when the response ends, or the worker's own queued prefill tokens from its
last /load report when those are more (work that reached it some other way).

A decode worker's load is different: the KV it holds (prompt + output tokens of its
running sequences), from the router's count or its reported KV usage, whichever is more.

Decision order (`Router.choose`):
    0. pinned     a worker that holds state the request needs (the stored response a
                  /v1/responses request continues), whatever its load, while healthy
    1. affinity   x-session-affinity -> the session's home on a consistent-hash ring;
       spill      ... or the next worker round the ring when the home is over the bound
    2. prefix     the worker holding the longest prefix of this prompt, if strictly
                  longer than on the others (a system prompt every worker holds decides
                  nothing) and not over the bound
    3. least-load the cheapest: load + the prompt tokens it would have to compute
The bound is `load_factor` x the mean load after placing the request (plus one request's
cost, so an idle cluster never refuses its home).

Workers whose /load names the same `kv_store` (a Mooncake Store they all share) can load
any prompt prefix one of them computed: the router remembers the prefixes sent to any of
them as that store's, and a worker's cost counts each stored token past its own hit at
STORE_HIT_COST of a computed one (a copy over the network, dearer than a local hit, far
cheaper than computing it), so a spilled or failed-over session is not charged a whole
recompute.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

CHUNK_CHARS = 64
CHARS_PER_TOKEN = 4
MAX_CHUNKS_PER_WORKER = 200_000
VIRTUAL_NODES = 64
# a token loaded from a shared store costs this much of a computed one (SmolLM2 fp32 on
# this box: a 16-token block of ~0.7 MB is copied in well under a millisecond, while
# computing it takes ~10 ms)
STORE_HIT_COST = 0.1


@dataclass(eq=False)
class Worker:
    url: str
    kind: str = "mixed"  # mixed | prefill | decode
    healthy: bool = True
    model: str | None = None  # the model it serves, from its /load (None: not known yet)
    source: str = "static"  # how it joined: static | register | the dns:// it was found by
    draining: bool = False  # leaving: takes no new request, forgotten once idle
    tokens_in_flight: int = 0
    requests_in_flight: int = 0
    reported: dict = field(default_factory=dict)  # its last /load report
    missed_checks: int = 0  # health checks in a row it was too busy to answer in time
    chunks: OrderedDict = field(default_factory=OrderedDict)  # prefix hashes, LRU

    @property
    def load(self) -> int:
        """Tokens of work ahead of a new request: the router's own count, or what the worker
        reports when that is more (work sent by other routers or clients): queued prefill
        tokens, or on a decode worker the tokens its KV cache holds."""
        report = self.reported
        if self.kind == "decode":
            reported = int(report.get("kv_blocks_used", 0)) * int(report.get("block_size", 0))
        else:
            reported = int(report.get("num_queued_prefill_tokens", 0))
        return max(self.tokens_in_flight, reported)

    @property
    def id(self) -> str:
        """A short name for it that its URL always gives (`DELETE /workers/{id}`)."""
        return "w" + hashlib.blake2b(self.url.encode(), digest_size=6).hexdigest()

    @property
    def store(self) -> str | None:
        """The shared KV store it reports (`kv_store` in /load), if any."""
        return self.reported.get("kv_store") or None

    def matched_chunks(self, hashes: list[bytes]) -> int:
        count = 0
        for h in hashes:
            if h not in self.chunks:
                break
            count += 1
        return count

    def remember(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.chunks[h] = None
            self.chunks.move_to_end(h)
        while len(self.chunks) > MAX_CHUNKS_PER_WORKER:
            self.chunks.popitem(last=False)


@dataclass(frozen=True)
class Decision:
    worker: Worker
    reason: str  # affinity | spill | prefix | least-load | retry
    cost: int  # tokens this request adds to the worker's load
    hashes: list[bytes]


class _Placement:
    """One request's cost on each worker, and the load bound, while it is being placed."""

    def __init__(
        self,
        text: str,
        max_tokens: int,
        workers: list[Worker],
        load_factor: float,
        stores: dict[str, Worker] | None = None,
    ):
        self.stores = stores or {}
        self.hashes = chunk_hashes(text)
        self.workers = workers
        self.prompt_tokens = len(text) // CHARS_PER_TOKEN + 1
        self.max_tokens = max_tokens
        size = self.prompt_tokens + max_tokens
        total = sum(w.load for w in workers)
        self.bound = load_factor * (total + size) / len(workers) + size

    def cost(self, worker: Worker) -> int:
        local = worker.matched_chunks(self.hashes)
        shared = self.stores.get(worker.store) if worker.store else None
        stored = max(shared.matched_chunks(self.hashes) - local, 0) if shared else 0
        cached, loaded = (n * CHUNK_CHARS // CHARS_PER_TOKEN for n in (local, stored))
        computed = max(self.prompt_tokens - cached - loaded, 1)
        return computed + round(loaded * STORE_HIT_COST) + self.max_tokens

    def fits(self, worker: Worker) -> bool:
        return worker.load + self.cost(worker) <= self.bound

    def longest_prefix(self) -> Worker | None:
        """The worker with the strictly longest match (a tie, e.g. a system prompt every
        worker holds, names nobody)."""
        matches = sorted(((w.matched_chunks(self.hashes), w) for w in self.workers),
                         key=lambda m: -m[0])  # fmt: skip
        runner_up = matches[1][0] if len(matches) > 1 else 0
        return matches[0][1] if matches[0][0] > runner_up else None

    def cheapest(self) -> Worker:
        return min(self.workers,
                   key=lambda w: (w.load + self.cost(w), w.requests_in_flight))  # fmt: skip

    def decide(self, worker: Worker, reason: str) -> Decision:
        return Decision(worker, reason, self.cost(worker), self.hashes)


def chunk_hashes(text: str) -> list[bytes]:
    """Chained hashes of the text's whole 64-character chunks."""
    hashes, parent = [], b""
    for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        parent = hashlib.blake2b(parent + text[start : start + CHUNK_CHARS].encode(),
                                 digest_size=16).digest()  # fmt: skip
        hashes.append(parent)
    return hashes


POLICIES = ("full", "least-load", "round-robin")


class Router:
    """`policy` "full" is the decision order above; "least-load" skips affinity and
    prefix; "round-robin" ignores everything (both for comparisons)."""

    def __init__(
        self, workers: list[str | Worker], load_factor: float = 1.25, policy: str = "full"
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        self.workers = [w if isinstance(w, Worker) else Worker(w.rstrip("/")) for w in workers]
        self.load_factor = load_factor
        self.policy = policy
        self._next = 0
        self._build_ring()
        # per shared store: the prefixes any worker using it computed (a Worker for its
        # bounded chunk set only)
        self.stores: dict[str, Worker] = {}

    def _build_ring(self) -> None:
        """The consistent-hash ring: a worker that joins or leaves moves only the sessions
        whose home it becomes or was."""
        self._ring = sorted(
            (_hash(f"{w.url}#{i}"), w) for w in self.workers for i in range(VIRTUAL_NODES)
        )  # fmt: skip
        self._keys = [key for key, _ in self._ring]

    def add(self, worker: Worker) -> None:
        if worker not in self.workers:
            self.workers.append(worker)
            self._build_ring()

    def remove(self, worker: Worker) -> None:
        if worker in self.workers:
            self.workers.remove(worker)
            self._build_ring()

    def healthy(self, exclude: set[str] = frozenset()) -> list[Worker]:
        """The workers that may take a new request (up, not leaving, not in `exclude`)."""
        return [w for w in self.workers
                if w.healthy and not w.draining and w.url not in exclude]  # fmt: skip

    def choose(
        self,
        text: str,
        max_tokens: int,
        session_id: str | None = None,
        exclude: set[str] = frozenset(),
        pinned: str | None = None,
    ) -> Decision | None:
        """The worker for a request (None when no worker is healthy); `pinned`: the URL of
        the worker that must serve it while it is healthy."""
        workers = self.healthy(exclude)
        if not workers:
            return None
        placement = _Placement(text, max_tokens, workers, self.load_factor, self.stores)
        home = next((w for w in workers if w.url == pinned), None)
        if home is not None:
            return placement.decide(home, "pinned")
        if self.policy == "round-robin":
            self._next += 1
            return placement.decide(workers[self._next % len(workers)], "round-robin")
        if self.policy == "full" and session_id is not None:
            for rank, worker in enumerate(self._ring_order(session_id, workers)):
                if placement.fits(worker):
                    return placement.decide(worker, "affinity" if rank == 0 else "spill")
        elif self.policy == "full":
            best = placement.longest_prefix()
            if best is not None and placement.fits(best):
                return placement.decide(best, "prefix")
        return placement.decide(placement.cheapest(), "least-load")

    def _ring_order(self, session_id: str, workers: list[Worker]) -> list[Worker]:
        """Distinct healthy workers in ring order from the session's hash."""
        allowed = {w.url for w in workers}
        start = bisect.bisect(self._keys, _hash(session_id))
        order: list[Worker] = []
        for i in range(len(self._ring)):
            worker = self._ring[(start + i) % len(self._ring)][1]
            if worker.url in allowed and worker not in order:
                order.append(worker)
        return order

    def start(self, decision: Decision) -> None:
        worker = decision.worker
        worker.tokens_in_flight += decision.cost
        worker.requests_in_flight += 1
        worker.remember(decision.hashes)
        if worker.store:  # written to the store as its blocks are saved
            self.stores.setdefault(worker.store, Worker(worker.store)).remember(decision.hashes)

    def finish(self, decision: Decision) -> None:
        worker = decision.worker
        worker.tokens_in_flight = max(worker.tokens_in_flight - decision.cost, 0)
        worker.requests_in_flight = max(worker.requests_in_flight - 1, 0)


class Pools:
    """One model's workers by role. Disaggregated requests need a prefill and a decode
    worker; whole requests go to the mixed pool, or (none healthy there) to any worker.
    Workers join and leave (`add`, `remove`; `members.Fleet` decides which)."""

    def __init__(
        self,
        mixed: Router | None = None,
        prefill: Router | None = None,
        decode: Router | None = None,
        load_factor: float = 1.25,
        policy: str = "full",
    ) -> None:
        given = next((r for r in (mixed, prefill, decode) if r is not None), None)
        if given is not None:
            load_factor, policy = given.load_factor, given.policy
        self.load_factor, self.policy = load_factor, policy
        self.mixed, self.prefill, self.decode = (
            r if r is not None else Router([], load_factor, policy) for r in (mixed, prefill, decode)
        )  # fmt: skip
        # whole requests when no mixed worker is up: the prefill and decode workers
        others = [*self.decode.workers, *self.prefill.workers]
        self._any = Router(others, load_factor, policy)

    @classmethod
    def from_urls(cls, mixed=(), prefill=(), decode=(), load_factor=1.25, policy="full") -> Pools:
        pools = cls(load_factor=load_factor, policy=policy)
        for kind, urls in (("prefill", prefill), ("decode", decode), ("mixed", mixed)):
            for url in urls:
                pools.add(Worker(url.rstrip("/"), kind))
        return pools

    @property
    def workers(self) -> list[Worker]:
        return [*self.mixed.workers, *self.prefill.workers, *self.decode.workers]

    def add(self, worker: Worker) -> None:
        getattr(self, worker.kind).add(worker)
        if worker.kind != "mixed":
            self._any.add(worker)

    def remove(self, worker: Worker) -> None:
        for router in (self.mixed, self.prefill, self.decode, self._any):
            router.remove(worker)

    @property
    def disaggregated(self) -> bool:
        """Whether it has workers of both roles (the request may still run whole when none
        of one role is up)."""
        return bool(self.prefill.workers and self.decode.workers)

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers if w.healthy and not w.draining]

    def for_whole_requests(self) -> Router:
        if self.mixed.healthy() or not self._any.workers:
            return self.mixed
        return self._any


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
