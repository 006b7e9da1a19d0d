"""Where a request goes: session affinity, then cached prefix, then least load by tokens.

The router never sees token ids, so it measures prompts in approximate tokens (characters
/ 4) and remembers, per worker, the chained hashes of the prompts' 64-character chunks
it sent there (an approximate prefix tree, as a bounded LRU set). Load is the router's
own count of tokens in flight on each worker (uncached prompt tokens + max output),
released when the response ends.

Decision order (`Router.choose`):
    1. affinity   x-session-affinity -> the session's home on a consistent-hash ring;
       spill      ... or the next worker round the ring when the home is over the bound
    2. prefix     the worker holding the longest prefix of this prompt, if strictly
                  longer than on the others (a system prompt every worker holds decides
                  nothing) and not over the bound
    3. least-load the cheapest: load + the prompt tokens it would have to compute
The bound is `load_factor` x the mean load after placing the request (plus one request's
cost, so an idle cluster never refuses its home).
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


@dataclass(eq=False)
class Worker:
    url: str
    healthy: bool = True
    tokens_in_flight: int = 0
    requests_in_flight: int = 0
    reported: dict = field(default_factory=dict)  # its last /load report
    chunks: OrderedDict = field(default_factory=OrderedDict)  # prefix hashes, LRU

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


def chunk_hashes(text: str) -> list[bytes]:
    """Chained hashes of the text's whole 64-character chunks."""
    hashes, parent = [], b""
    for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        parent = hashlib.blake2b(parent + text[start : start + CHUNK_CHARS].encode(),
                                 digest_size=16).digest()  # fmt: skip
        hashes.append(parent)
    return hashes


class Router:
    def __init__(self, urls: list[str], load_factor: float = 1.25) -> None:
        if not urls:
            raise ValueError("the router needs at least one worker")
        self.workers = [Worker(url.rstrip("/")) for url in urls]
        self.load_factor = load_factor
        self._ring = sorted(
            (_hash(f"{w.url}#{i}"), w) for w in self.workers for i in range(VIRTUAL_NODES)
        )  # fmt: skip
        self._keys = [key for key, _ in self._ring]

    def healthy(self, exclude: set[str] = frozenset()) -> list[Worker]:
        return [w for w in self.workers if w.healthy and w.url not in exclude]

    def choose(
        self,
        text: str,
        max_tokens: int,
        session_id: str | None = None,
        exclude: set[str] = frozenset(),
    ) -> Decision | None:
        """The worker for a request (None when no worker is healthy)."""
        workers = self.healthy(exclude)
        if not workers:
            return None
        hashes = chunk_hashes(text)
        prompt_tokens = len(text) // CHARS_PER_TOKEN + 1

        def cost(w: Worker) -> int:
            cached = w.matched_chunks(hashes) * CHUNK_CHARS // CHARS_PER_TOKEN
            return max(prompt_tokens - cached, 1) + max_tokens

        total = sum(w.tokens_in_flight for w in workers)
        bound = self.load_factor * (total + prompt_tokens + max_tokens) / len(workers)
        bound += prompt_tokens + max_tokens

        def fits(w: Worker) -> bool:
            return w.tokens_in_flight + cost(w) <= bound

        if session_id is not None:
            for rank, worker in enumerate(self._ring_order(session_id, workers)):
                if fits(worker):
                    return Decision(
                        worker, "affinity" if rank == 0 else "spill", cost(worker), hashes
                    )
        else:
            matches = sorted(((w.matched_chunks(hashes), w) for w in workers), key=lambda m: -m[0])
            best, runner_up = matches[0][0], (matches[1][0] if len(matches) > 1 else 0)
            if best > runner_up and fits(matches[0][1]):
                return Decision(matches[0][1], "prefix", cost(matches[0][1]), hashes)
        worker = min(workers, key=lambda w: (w.tokens_in_flight + cost(w), w.requests_in_flight))
        return Decision(worker, "least-load", cost(worker), hashes)

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

    def finish(self, decision: Decision) -> None:
        worker = decision.worker
        worker.tokens_in_flight = max(worker.tokens_in_flight - decision.cost, 0)
        worker.requests_in_flight = max(worker.requests_in_flight - 1, 0)


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
