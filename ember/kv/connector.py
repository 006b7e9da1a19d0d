"""KV connectors: what moves KV between an engine's pool and the outside.

A connector has two halves. The scheduler half (`KVConnector`, called by the scheduler
on the engine thread only) decides: how many of a request's prompt tokens will come from
outside rather than be computed (`external_tokens`; None: "not known yet, ask again next
step"), starting a load once the request's blocks are allocated (`start_load`), which
loads ended (`finished_loads`), and what happens to a request's blocks when it ends
(`request_finished`: held for someone to fetch, or saved). It never touches KV memory.
The worker half moves bytes, off the engine thread: `disagg.KVConnectorWorker` (a
prefill worker's KV endpoint, transports) and `tiers.TieredStore` (host memory, disk,
the cluster store). Both halves live in the engine-core process.

Connectors by name (`CONNECTORS`, `register_connector`, `make_connector`):
- `disagg`: prefill/decode disaggregation (ember.kv.disagg);
- `tiers`: the tiers below the pool (ember.kv.store_connector), when configured;
- `module.path:factory`: one of your own, `factory(context) -> KVConnector | None`.
An engine runs their composition (`MultiConnector`): every connector sees every request;
the first to claim a request's prompt (nonzero `external_tokens`) loads it; a finished
request is offered to each (one may hold its blocks, the others save them).

A request whose load fails (refused, timed out, corrupt) recomputes its prompt like any
other; a connector must not claim it again (`KVStats.loads_failed` counts it).
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ember.kv.layout import WorkerKV

logger = logging.getLogger("ember.kv")


@dataclass
class KVStats:
    """Counters since start, for /load and /metrics (shared by an engine's connectors)."""

    loads_ok: int = 0
    loads_failed: int = 0
    bytes_received: int = 0
    load_seconds: list[float] = field(default_factory=list)  # recent ones, for percentiles
    load_seconds_total: float = 0.0
    holds_expired: int = 0


@dataclass
class _Load:
    request: object  # the engine's Request
    future: Future  # its result: the bytes loaded
    started: float
    cancel: Callable[[], bool] | None = None  # given up after the timeout, if it can be


class KVConnector:
    """The scheduler half. The defaults do nothing: a connector overrides what it needs."""

    name = "base"

    def __init__(self, stats: KVStats | None = None, load_timeout: float | None = None) -> None:
        self.stats = stats or KVStats()
        self.load_timeout = load_timeout  # None: a load's own transport times it out
        self._loads: dict[str, _Load] = {}

    def close(self) -> None:
        """Stops the worker half (threads, endpoints)."""

    def request_added(self, request, num_local_hit: int) -> None:
        """A request arrived (its block hashes are known, and the prefix the pool holds
        now): start slow lookups and fetches now."""

    def external_tokens(self, request, num_local_hit: int) -> int | None:
        """Prompt tokens past the local prefix-cache hit that this connector will load
        (0: none; None: not known yet, the request waits a step)."""
        return 0

    def start_load(self, request, block_ids: list[int], num_local_hit: int) -> None:
        """Loads the claimed tokens into the request's newly allocated blocks, up to
        `request.num_loaded_end` (in the background: see `_track`). A connector that
        claims tokens in `external_tokens` defines it."""
        raise TypeError(f"the {self.name!r} KV connector claimed tokens it cannot load")

    def release_unused(self, request) -> None:
        """The request is admitted with nothing (more) to load: drop what was kept for it."""

    def cached_tokens(self, request, num_local_hit: int) -> int | None:
        """The prompt tokens to report as cached, if this connector knows better than the
        local hit (None: it does not); by default, for a prompt it loads, the local hit
        and what it loads."""
        return max(num_local_hit, request.num_loaded_end) if request.num_loaded_end else None

    def request_finished(self, request, block_ids: list[int], at_length: bool):
        """A request ended (at its token limit: `at_length`), its blocks not yet freed:
        returns the params for whoever will fetch them if this connector holds them (they
        are freed when `collect` names the transfer), else None."""
        return None

    def save(self, request, block_ids: list[int]) -> None:
        """A preempted request's computed blocks, about to be freed."""

    def blocks_computed(self, request, block_ids: list[int], start: int, end: int) -> None:
        """A step computed the KV that fills the request's blocks [start, end)."""

    def block_evicted(self, block_hash: bytes, block_id: int) -> None:
        """A cached block is about to be reused for other KV (its bytes still there)."""

    def drop_hold(self, request_id: str) -> None:
        """The frontend will not hand this request's held blocks over."""

    def collect(self) -> list[str]:
        """Transfer ids whose held blocks may be freed now."""
        return []

    @property
    def num_held(self) -> int:
        return 0

    @property
    def bytes_sent(self) -> int:
        """KV bytes others fetched from this engine, since start."""
        return 0

    @property
    def num_looking_up(self) -> int:
        """Waiting requests whose `external_tokens` is not known yet."""
        return 0

    # -- loads in flight, common to every connector ------------------------------------

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def _track(self, request, future: Future, cancel: Callable[[], bool] | None = None) -> None:
        self._loads[request.request_id] = _Load(request, future, time.monotonic(), cancel)

    def _load_failed(self, request) -> None:
        """A load of this request's prompt failed: it recomputes."""

    def finished_loads(self) -> list[tuple[object, bool]]:
        """Loads that ended since the last call: (request, succeeded). A load past the
        timeout that can be cancelled counts as failed."""
        done = []
        now = time.monotonic()
        for request_id, load in list(self._loads.items()):
            late = self.load_timeout is not None and now - load.started > self.load_timeout
            if not load.future.done() and not (late and load.cancel and load.cancel()):
                continue
            del self._loads[request_id]
            seconds = now - load.started
            try:
                if not load.future.done():
                    raise TimeoutError(f"no answer in {self.load_timeout} s")
                num_bytes = load.future.result()
            except Exception as exc:  # noqa: BLE001 - any failure means: recompute
                logger.warning("KV load for %s failed (%s); recomputing", request_id, exc)
                self.stats.loads_failed += 1
                self._load_failed(load.request)
                done.append((load.request, False))
                continue
            self.stats.loads_ok += 1
            self.stats.bytes_received += num_bytes
            self.stats.load_seconds = (self.stats.load_seconds + [seconds])[-1000:]
            self.stats.load_seconds_total += seconds
            done.append((load.request, True))
        return done


class MultiConnector(KVConnector):
    """Several connectors as one, in order: the first to claim a prompt loads it."""

    name = "multi"

    def __init__(self, connectors: Sequence[KVConnector], stats: KVStats) -> None:
        super().__init__(stats)
        self.connectors = list(connectors)
        self._owner: dict[str, KVConnector] = {}  # request id -> the connector loading it

    def get(self, name: str) -> KVConnector | None:
        return next((c for c in self.connectors if c.name == name), None)

    def close(self) -> None:
        for connector in self.connectors:
            connector.close()

    def request_added(self, request, num_local_hit: int) -> None:
        for connector in self.connectors:
            connector.request_added(request, num_local_hit)

    def external_tokens(self, request, num_local_hit: int) -> int | None:
        for connector in self.connectors:
            num = connector.external_tokens(request, num_local_hit)
            if num is None or num:
                if num:
                    self._owner[request.request_id] = connector
                return num
        return 0

    def start_load(self, request, block_ids: list[int], num_local_hit: int) -> None:
        self._owner[request.request_id].start_load(request, block_ids, num_local_hit)

    def finished_loads(self) -> list[tuple[object, bool]]:
        done = [item for c in self.connectors for item in c.finished_loads()]
        for request, _ in done:
            self._owner.pop(request.request_id, None)
        return done

    def release_unused(self, request) -> None:
        self._owner.pop(request.request_id, None)
        for connector in self.connectors:
            connector.release_unused(request)

    def cached_tokens(self, request, num_local_hit: int) -> int:
        owner = self._owner.get(request.request_id)
        for connector in [owner] if owner is not None else self.connectors:
            num = connector.cached_tokens(request, num_local_hit)
            if num is not None:
                return num
        return num_local_hit

    def request_finished(self, request, block_ids: list[int], at_length: bool):
        self._owner.pop(request.request_id, None)
        held = None
        for connector in self.connectors:
            held = connector.request_finished(request, block_ids, at_length) or held
        return held

    def save(self, request, block_ids: list[int]) -> None:
        for connector in self.connectors:
            connector.save(request, block_ids)

    def blocks_computed(self, request, block_ids: list[int], start: int, end: int) -> None:
        for connector in self.connectors:
            connector.blocks_computed(request, block_ids, start, end)

    def block_evicted(self, block_hash: bytes, block_id: int) -> None:
        for connector in self.connectors:
            connector.block_evicted(block_hash, block_id)

    def drop_hold(self, request_id: str) -> None:
        for connector in self.connectors:
            connector.drop_hold(request_id)

    def collect(self) -> list[str]:
        return [key for c in self.connectors for key in c.collect()]

    @property
    def num_held(self) -> int:
        return sum(c.num_held for c in self.connectors)

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.connectors)

    @property
    def num_looking_up(self) -> int:
        return sum(c.num_looking_up for c in self.connectors)

    @property
    def num_loading(self) -> int:
        return sum(c.num_loading for c in self.connectors)


@dataclass
class ConnectorContext:
    """What a connector factory gets: the engine's config and KV, and the shared stats."""

    config: object  # EngineConfig
    # every rank's KV tensors, what each holds, and their shared-memory file, if any
    # (ember.kv.layout); None for a model over ranks whose KV stays with each rank (a
    # mixed worker without tiers): then a connector that moves KV must decline. One that
    # writes blocks into `kv.tensors` calls `kv.fill_replicas(block_ids)` after
    kv: WorkerKV | None
    kv_identity: str  # what the KV depends on (checkpoint, layout, precision)
    stats: KVStats

    @property
    def kv_caches(self) -> Sequence[torch.Tensor]:
        """The KV tensors that move, one per distinct piece."""
        return self.kv.tensors if self.kv is not None else []


ConnectorFactory = Callable[[ConnectorContext], "KVConnector | None"]
# name -> factory, or "module:factory" to import when first used
CONNECTORS: dict[str, ConnectorFactory | str] = {
    "disagg": "ember.kv.disagg:make_disagg",
    "tiers": "ember.kv.store_connector:make_tiers",
}


def register_connector(name: str, factory: ConnectorFactory) -> None:
    """Makes `factory` available as `name` in `kv_connectors`."""
    CONNECTORS[name] = factory


def _factory(name: str) -> ConnectorFactory:
    target = CONNECTORS.get(name, name)
    if callable(target):
        return target
    module, sep, attr = target.partition(":")
    if not sep:
        known = ", ".join(sorted(CONNECTORS))
        raise ValueError(
            f"kv_connectors: no connector {name!r} (known: {known}, or module:factory)"
        )
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"kv_connectors: cannot load {name!r}: {exc}") from None


def make_connector(names: Sequence[str], context: ConnectorContext) -> MultiConnector:
    """The named connectors, in order, as one (a factory may decline: None)."""
    connectors = []
    try:
        for name in names:
            connector = _factory(name)(context)
            if connector is not None:
                connectors.append(connector)
    except BaseException:
        for connector in connectors:
            connector.close()
        raise
    return MultiConnector(connectors, context.stats)
