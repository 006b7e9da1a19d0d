"""KV tiers below the engine's pool: host memory, local disk, and a cluster store.

A block leaves the engine's pool when its request finishes or is preempted; its bytes
are copied (on the engine thread, between steps: a memcpy) into the host tier, and from
there written to disk by a background thread. A later request whose prompt shares the
prefix finds the blocks past its local prefix-cache hit in a tier and has them copied
back into newly allocated blocks by a loader thread, while other requests keep stepping
(the connector's WAITING_FOR_KV path); a block missing or corrupt on the way makes the
load fail, and the request recomputes its prompt as any other.

Keys: a block's chained hash (ember.engine.kv_cache: it covers every token before it
and the request's cache salt) hashed again with the store's namespace, which covers the
checkpoint's identity, the KV layout and dtype, the block size and the precision the
KV was computed in. KV of another model, tenant, layout or precision never matches.

Disk: one file per block (ember.kv.disk_tier), surviving a restart. Each tier evicts its
least recently used block when full.

Cluster: Mooncake Store (ember.kv.mooncake.MooncakeStoreTier), shared by every worker
pointed at the same master. Blocks are written to it by a background thread as they are
saved; whether a request's blocks are there is asked once, when the request arrives
(`lookup`), in a background thread, so the step loop never waits on the network; loads
read it after host memory and disk.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ember.kv.buffers import DeviceBlocks, block_bytes, chunks
from ember.kv.disk_tier import DiskTier

logger = logging.getLogger("ember.kv")

# disk writes waiting in memory beyond this are dropped (the block stays in host memory)
MAX_PENDING_WRITE_BYTES = 256 << 20
# a load waits at most this long for a prefetch already reading its block
PREFETCH_WAIT_S = 5.0
# a KV cache on a device: blocks move through rows on it of at most this many bytes at once
MAX_ROW_BYTES = 256 << 20


class StoreMiss(Exception):
    """A block was not (or no longer) in any tier, or failed its checks."""


@dataclass
class TierCounters:
    """One tier's counters since start (for /load and /metrics)."""

    hits: int = 0  # blocks loaded from it
    bytes_loaded: int = 0
    load_seconds: float = 0.0  # spent reading it
    writes: int = 0  # blocks stored into it
    writes_dropped: int = 0  # its writer fell behind by MAX_PENDING_WRITE_BYTES, or it refused
    evictions: int = 0
    corrupt: int = 0  # blocks that failed their checks (dropped)
    write_errors: int = 0  # writes that failed (a full disk once older blocks are gone)


TIERS = ("host", "disk", "cluster")


@dataclass
class TierStats:
    host: TierCounters = field(default_factory=TierCounters)
    disk: TierCounters = field(default_factory=TierCounters)
    cluster: TierCounters = field(default_factory=TierCounters)
    lookups_failed: int = 0  # cluster lookups that failed or came too late
    prefetched: int = 0  # blocks read into host memory while their request was queued

    def as_dict(self) -> dict[str, dict[str, float]]:
        tiers = {name: dict(vars(getattr(self, name))) for name in TIERS}
        tiers["cluster"]["lookups_failed"] = self.lookups_failed
        tiers["host"]["prefetched"] = self.prefetched
        return tiers


def namespace(identity: str) -> bytes:
    """The 16-byte namespace of a model + KV layout description."""
    return hashlib.sha256(b"ember-kv-store:" + identity.encode()).digest()[:16]


class HostTier:
    """Blocks in host memory: a preallocated pool of `capacity // block_bytes` slots
    (`pinned`, for a KV cache on CUDA: page-locked, so a block moves to and from the
    device in one DMA copy).

    Two LRU lists: blocks of agent sessions (`retain`) are evicted only when no other block
    is left."""

    def __init__(
        self, capacity: int, block_bytes: int, stats: TierCounters, pinned: bool = False
    ) -> None:
        num_slots = capacity // block_bytes
        if num_slots < 1:
            raise ValueError(
                f"kv_offload_memory of {capacity} bytes holds no block of {block_bytes} bytes"
            )
        self.buffer = torch.empty((num_slots, block_bytes), dtype=torch.uint8, pin_memory=pinned)
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, LRU first
        self.kept: OrderedDict[bytes, int] = OrderedDict()  # the sessions' blocks
        self._free = list(range(num_slots - 1, -1, -1))
        self.lock = threading.Lock()
        self._stats = stats

    def __contains__(self, key: bytes) -> bool:
        with self.lock:
            return key in self.slots or key in self.kept

    def put(
        self,
        key: bytes,
        views: Iterable[memoryview] | torch.Tensor,
        copy: bool = False,
        retain: bool = False,
    ) -> bytes | None:
        """Copies a block in (evicting the least recently used one if full), now the most
        recent of its list (`retain`: the sessions'); with `copy`, returns a copy of its
        bytes, taken under the same lock. `views`: the block's bytes in pieces, or a row
        of them on a device (DeviceBlocks), copied in before this returns."""
        with self.lock:
            slot = self.slots.pop(key, None)
            if slot is None:
                slot = self.kept.pop(key, None)
                retain = retain or slot is not None  # once a session's, kept as one
            if slot is None:
                if self._free:
                    slot = self._free.pop()
                else:
                    _, slot = (self.slots or self.kept).popitem(last=False)
                    self._stats.evictions += 1
                if isinstance(views, torch.Tensor):
                    self.buffer[slot].copy_(views)
                else:
                    _gather(views, self._view(slot))
                self._stats.writes += 1
            (self.kept if retain else self.slots)[key] = slot
            return bytes(self._view(slot)) if copy else None

    def find(self, key: bytes) -> torch.Tensor | None:
        """A block's bytes in place (a uint8 row), now the most recent (hold `lock` while
        using them)."""
        for lru in (self.slots, self.kept):
            slot = lru.get(key)
            if slot is not None:
                lru.move_to_end(key)
                return self.buffer[slot]
        return None

    def _view(self, slot: int) -> memoryview:
        return _bytes_of(self.buffer[slot])


def _bytes_of(row: torch.Tensor) -> memoryview:
    return memoryview(row.numpy()).cast("B")


def _gather(views: Iterable[memoryview], target: memoryview) -> None:
    offset = 0
    for view in views:
        target[offset : offset + len(view)] = view
        offset += len(view)


def _scatter(source: memoryview | torch.Tensor, targets: Sequence[memoryview] | torch.Tensor):
    """A block's bytes (in host memory: a host tier's row, or bytes read) into its places
    (views into a CPU KV cache, or a row on the device, DeviceBlocks)."""
    if isinstance(targets, torch.Tensor):
        if not isinstance(source, torch.Tensor):
            with warnings.catch_warnings():  # read only: bytes are not writable
                warnings.simplefilter("ignore", UserWarning)
                source = torch.frombuffer(source, dtype=torch.uint8)
        targets.copy_(source)  # pinned (a host tier's) or pageable: waits for the copy
        return
    if isinstance(source, torch.Tensor):
        source = _bytes_of(source)
    offset = 0
    for target in targets:
        target[:] = source[offset : offset + len(target)]
        offset += len(target)


class _Writer:
    """One background thread writing blocks into a tier, with a cap on queued bytes."""

    def __init__(self, name: str, write, stats: TierCounters) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ember-kv-{name}")
        self._write = write
        self._stats = stats
        self._pending = 0
        self._lock = threading.Lock()

    def submit(self, key: bytes, data: bytes, retain: bool) -> None:
        with self._lock:
            if self._pending + len(data) > MAX_PENDING_WRITE_BYTES:
                self._stats.writes_dropped += 1
                return
            self._pending += len(data)
        self._pool.submit(self._run, key, data, retain)

    def _run(self, key: bytes, data: bytes, retain: bool) -> None:
        try:
            self._write(key, data, retain)
        except Exception as exc:  # noqa: BLE001 - a tier that fails to store loses a block
            logger.warning("KV block not stored: %s", exc)
            self._stats.writes_dropped += 1
        finally:
            with self._lock:
                self._pending -= len(data)

    def flush(self) -> None:
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class Cancelled(StoreMiss):
    """The load was given up (it took too long); its blocks may already be someone else's."""


class TierLoad:
    """A load in flight: `future` gives the bytes loaded; `cancel()` makes sure no byte is
    written into the request's blocks after it returns True."""

    def __init__(self) -> None:
        self.future: Future | None = None
        self._lock = threading.Lock()
        self._cancelled = False

    def cancel(self) -> bool:
        """False if the load had already ended."""
        with self._lock:
            if self.future is not None and self.future.done():
                return False
            self._cancelled = True
            return True

    def scatter(self, source, targets) -> None:
        with self._lock:
            if self._cancelled:
                raise Cancelled("the load was given up")
            _scatter(source, targets)

    def commit(self, write: Callable[[], None]) -> None:
        """Runs `write` (the last step of a load, which writes into the request's blocks)
        unless the load was given up."""
        with self._lock:
            if self._cancelled:
                raise Cancelled("the load was given up")
            write()


class KnownKeys:
    """Keys recently seen in the cluster tier (so a block is not written twice), LRU."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._keys

    def add(self, key: bytes) -> None:
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            if len(self._keys) > self._capacity:
                self._keys.popitem(last=False)

    def discard(self, key: bytes) -> None:
        with self._lock:
            self._keys.pop(key, None)


class TieredStore:
    """The tiers of one engine: saves blocks out of its KV tensors, loads them back."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        identity: str,
        host_bytes: int | None,
        disk_dir: str | None,
        disk_bytes: int,
        cluster=None,  # a MooncakeStoreTier (exists, put, get, close), or None
        session_ttl: float = 3600.0,
        loaded: Callable[[list[int]], None] | None = None,  # after a load: fill replicas
    ) -> None:
        self.kv_caches = kv_caches
        self._loaded = loaded
        self.block_bytes = block_bytes(kv_caches)
        self.space = namespace(identity)
        self.stats = TierStats()
        stats = self.stats
        # a KV cache on a device: blocks move as rows (DeviceBlocks), a host tier pinned
        on_device = bool(kv_caches) and kv_caches[0].device.type != "cpu"
        self.device_blocks = DeviceBlocks(kv_caches) if on_device else None
        self.host = None
        if host_bytes:
            self.host = HostTier(host_bytes, self.block_bytes, stats.host, pinned=on_device)
        self.disk = None
        if disk_dir:
            self.disk = DiskTier(disk_dir, disk_bytes, self.space, stats.disk, session_ttl)
        self.session_ttl = session_ttl
        self.cluster = cluster
        self._in_cluster = KnownKeys()
        self._disk_writer = _Writer("disk", self.disk.write, stats.disk) if self.disk else None
        self._cluster_writer = _Writer("store", self._put, stats.cluster) if cluster else None
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ember-kv-tier")
        self._lookups = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ember-kv-lookup")
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ember-kv-fetch")
        self._fetching: dict[bytes, threading.Event] = {}  # blocks a prefetch is reading
        self._fetch_lock = threading.Lock()

    def close(self) -> None:
        for writer in (self._disk_writer, self._cluster_writer):
            if writer is not None:
                writer.close()  # queued writes finish: a restart finds them
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self._prefetcher.shutdown(wait=False, cancel_futures=True)
        if self.cluster is not None:
            self.cluster.close()

    def key(self, block_hash: bytes) -> bytes:
        return hashlib.sha256(self.space + block_hash).digest()[:16]

    def has(self, block_hash: bytes) -> bool:
        """Whether this worker's own tiers (host memory, disk) hold the block."""
        key = self.key(block_hash)
        return (self.host is not None and key in self.host) or (
            self.disk is not None and key in self.disk
        )

    def lookup(self, block_hashes: Sequence[bytes]) -> Future:
        """In the background: which of these blocks the cluster tier holds (list[bool])."""
        return self._lookups.submit(self._lookup, list(block_hashes))

    def _lookup(self, block_hashes: list[bytes]) -> list[bool]:
        keys = [self.key(h) for h in block_hashes]
        found = self.cluster.exists(keys)
        for key, present in zip(keys, found, strict=True):
            if present:
                self._in_cluster.add(key)
        return found

    def prefetch(
        self, block_hashes: Sequence[bytes], in_cluster: Sequence[bool] = (), retain: bool = False
    ) -> None:
        """In the background, while the request waits in the queue: its stored blocks not
        in host memory yet (the leading run, from disk, or from the cluster where
        `in_cluster` says so) are read into host memory, so that its load when admitted
        is a memcpy. `retain`: a session's blocks (in host memory with the sessions', so
        that saving other sessions' blocks does not evict them before the load)."""
        if self.host is not None and (self.disk is not None or any(in_cluster)):
            self._prefetcher.submit(self._prefetch, list(block_hashes), list(in_cluster), retain)

    def _prefetch(self, block_hashes: list[bytes], in_cluster: list[bool], retain: bool) -> None:
        run = []  # the leading blocks stored below host memory, claimed for this read
        for i, block_hash in enumerate(block_hashes):
            key = self.key(block_hash)
            on_disk = self.disk is not None and key in self.disk
            if not (on_disk or key in self.host or (i < len(in_cluster) and in_cluster[i])):
                break
            run.append((key, on_disk))
        with self._fetch_lock:
            for key, _ in run:
                self._fetching.setdefault(key, threading.Event())
        try:
            for key, on_disk in run:
                if key in self.host:
                    continue
                data = self.disk.read(key, self.block_bytes) if on_disk else None
                if data is None and not on_disk:
                    data = self.cluster.get(key, self.block_bytes) or None
                if data is None:
                    return
                self.host.put(key, [memoryview(data)], retain=retain)
                self.stats.prefetched += 1
                self._fetched(key)
        finally:
            for key, _ in run:
                self._fetched(key)

    def _fetched(self, key: bytes) -> None:
        with self._fetch_lock:
            event = self._fetching.pop(key, None)
        if event is not None:
            event.set()

    def _wait_fetch(self, key: bytes) -> None:
        """If a prefetch is reading this block, until it is done (so it is read once)."""
        with self._fetch_lock:
            event = self._fetching.get(key)
        if event is not None:
            event.wait(PREFETCH_WAIT_S)

    def save(self, blocks: Iterable[tuple[bytes, int]], retain: bool = False) -> None:
        """Copies (block hash, block id) pairs not yet stored out of the KV tensors (call
        between steps, before the blocks are freed); disk and cluster writes go on in the
        background. `retain`: an agent session's blocks, evicted last (host memory, the
        store's soft pin) and kept on disk for the session TTL."""
        blocks = list(blocks)
        if self.device_blocks is None:
            self._save(blocks, None, retain)
            return
        for group in self._groups(blocks):  # on a device: a group's bytes gathered at once
            self._save(group, self.device_blocks.gather([b for _, b in group]), retain)

    def _groups(self, blocks: list) -> Iterator[list]:
        """`blocks` in groups whose rows on the device stay within MAX_ROW_BYTES."""
        size = max(1, MAX_ROW_BYTES // self.block_bytes)
        for start in range(0, len(blocks), size):
            yield blocks[start : start + size]

    def _save(self, blocks: list, rows: torch.Tensor | None, retain: bool) -> None:
        for i, (block_hash, block_id) in enumerate(blocks):
            key = self.key(block_hash)
            on_disk = self.disk is not None and key in self.disk
            to_disk = self.disk is not None and not on_disk
            to_cluster = self.cluster is not None and key not in self._in_cluster
            views = chunks(self.kv_caches, [block_id]) if rows is None else rows[i]
            if self.host is not None:
                copy = to_disk or to_cluster  # now the most recent:
                data = self.host.put(key, views, copy=copy, retain=retain)
            elif to_disk or to_cluster:
                data = b"".join(views) if rows is None else views.cpu().numpy().tobytes()
            if to_disk:
                self._disk_writer.submit(key, data, retain)
            elif on_disk and retain:  # its TTL starts again
                self._disk_writer.submit(key, b"", True)
            if to_cluster:
                self._in_cluster.add(key)  # written once, even while the write is queued
                self._cluster_writer.submit(key, data, retain)

    def _put(self, key: bytes, data: bytes, retain: bool) -> None:
        if self.cluster.put(key, data, self.session_ttl if retain else 0.0):
            self.stats.cluster.writes += 1
        else:
            self._in_cluster.discard(key)
            self.stats.cluster.writes_dropped += 1

    def flush(self) -> None:
        """Waits for the disk and cluster writes, and the prefetches, queued so far."""
        for writer in (self._disk_writer, self._cluster_writer):
            if writer is not None:
                writer.flush()
        self._prefetcher.submit(lambda: None).result()

    def load(self, blocks: Sequence[tuple[bytes, int]], retain: bool = False) -> TierLoad:
        """Copies (block hash, block id) pairs from the tiers into the KV tensors in a
        background thread; the load's future gives the bytes loaded or raises StoreMiss.
        Blocks read from disk or the cluster are kept in host memory (`retain`: with the
        sessions')."""
        load = TierLoad()
        load.future = self._loader.submit(self._load, list(blocks), load, retain)
        return load

    def _load(self, blocks: list[tuple[bytes, int]], load: TierLoad, retain: bool) -> int:
        device = self.device_blocks
        if device is None:
            self._read_into(blocks, load, retain, None)
        else:  # each block into a row on the device, then a group's rows into its blocks
            with device.stream():
                for group in self._groups(blocks):
                    rows = device.rows(len(group))
                    self._read_into(group, load, retain, rows)
                    ids = [block_id for _, block_id in group]
                    load.commit(lambda ids=ids, rows=rows: device.scatter(ids, rows))
        if self._loaded is not None:
            self._loaded([block_id for _, block_id in blocks])
        return len(blocks) * self.block_bytes

    def _rows_from_host(self, blocks, rows: torch.Tensor) -> int:
        """The leading blocks that host memory holds, copied into their rows on the device
        all at once (waited for under the tier's lock, so no slot changes meanwhile);
        how many."""
        keys = [self.key(block_hash) for block_hash, _ in blocks]
        for key in keys:
            self._wait_fetch(key)
        start, count = time.perf_counter(), 0
        with self.host.lock:
            for i, key in enumerate(keys):
                slot = self.host.find(key)
                if slot is None:
                    break
                rows[i].copy_(slot, non_blocking=True)  # pinned: DMA, in the stream's order
                count = i + 1
            if count and rows.device.type == "cuda":
                torch.cuda.current_stream(rows.device).synchronize()
        host = self.stats.host
        host.hits += count
        host.bytes_loaded += count * self.block_bytes
        host.load_seconds += time.perf_counter() - start
        return count

    def _read_into(self, blocks, load: TierLoad, retain: bool, rows: torch.Tensor | None):
        """Each block's bytes from the first tier that holds it, into its places in the KV
        tensors, or into its row of `rows` (a KV cache on a device)."""
        first = 0
        if rows is not None and self.host is not None:
            first = self._rows_from_host(blocks, rows)
        for i, (block_hash, block_id) in enumerate(blocks):
            if i < first:
                continue
            key = self.key(block_hash)
            targets = list(chunks(self.kv_caches, [block_id])) if rows is None else rows[i]
            start = time.perf_counter()
            if self.host is not None:
                self._wait_fetch(key)
                with self.host.lock:
                    slot = self.host.find(key)
                    if slot is not None:
                        load.scatter(slot, targets)
                if slot is not None:
                    self._count(self.stats.host, start)
                    continue
            tier, data = self.stats.disk, None
            if self.disk is not None:
                data = self.disk.read(key, self.block_bytes)
            if data is None and self.cluster is not None:
                tier, data = self.stats.cluster, self.cluster.get(key, self.block_bytes)
                if not data:
                    self._in_cluster.discard(key)
                    tier.corrupt += data is not None  # b"": it failed its MAC
                    data = None
            if data is None:
                raise StoreMiss(f"KV block {key.hex()} is no longer stored")
            load.scatter(memoryview(data), targets)
            self._count(tier, start)
            if self.host is not None:  # the next turn finds it in memory
                self.host.put(key, [memoryview(data)], retain=retain)

    def _count(self, tier: TierCounters, start: float) -> None:
        tier.hits += 1
        tier.bytes_loaded += self.block_bytes
        tier.load_seconds += time.perf_counter() - start
