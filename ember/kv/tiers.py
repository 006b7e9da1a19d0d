"""KV tiers below the engine's pool: host memory and local disk.

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

Disk: one file per block, `<dir>/<namespace>/<key>.kvb`: a header (magic, key, length,
CRC-32 of the bytes) and the block's bytes, written to a temporary file and renamed into
place, so a reader sees a whole block or none; a file whose header or checksum does not
match is deleted on read. The files outlive the process: a restarted worker indexes
them (oldest first, for LRU eviction) and serves warm. Each tier evicts its least
recently used block when full.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ember.kv.buffers import block_bytes, chunks

logger = logging.getLogger("ember.kv")

MAGIC = b"EMBERKV1"
_HEADER = struct.Struct("<8s16sQI")  # magic, key, length, crc32
SUFFIX = ".kvb"
# disk writes waiting in memory beyond this are dropped (the block stays in host memory)
MAX_PENDING_WRITE_BYTES = 256 << 20


class StoreMiss(Exception):
    """A block was not (or no longer) in any tier, or failed its checks."""


@dataclass
class TierStats:
    """Counters since start, per tier (for /load and /metrics)."""

    host_hits: int = 0  # blocks loaded from host memory
    disk_hits: int = 0
    host_saves: int = 0  # blocks copied into host memory
    disk_writes: int = 0
    disk_writes_dropped: int = 0  # the writer fell behind by MAX_PENDING_WRITE_BYTES
    bytes_loaded: int = 0
    host_evictions: int = 0
    disk_evictions: int = 0
    disk_corrupt: int = 0  # files that failed their header or checksum (deleted)


def namespace(identity: str) -> bytes:
    """The 16-byte namespace of a model + KV layout description."""
    return hashlib.sha256(b"ember-kv-store:" + identity.encode()).digest()[:16]


class HostTier:
    """Blocks in host memory: a preallocated pool of `capacity // block_bytes` slots."""

    def __init__(self, capacity: int, block_bytes: int, stats: TierStats) -> None:
        num_slots = capacity // block_bytes
        if num_slots < 1:
            raise ValueError(
                f"kv_offload_memory of {capacity} bytes holds no block of {block_bytes} bytes"
            )
        self.buffer = torch.empty((num_slots, block_bytes), dtype=torch.uint8)
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, LRU first
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.Lock()
        self._stats = stats

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self.slots

    def put(self, key: bytes, views: Iterable[memoryview], copy: bool = False) -> bytes | None:
        """Copies a block in (evicting the least recently used one if full); with `copy`,
        returns a copy of its bytes, taken under the same lock."""
        with self._lock:
            slot = self.slots.get(key)
            if slot is not None:
                self.slots.move_to_end(key)
            else:
                if self._free:
                    slot = self._free.pop()
                else:
                    _, slot = self.slots.popitem(last=False)
                    self._stats.host_evictions += 1
                target, offset = self._view(slot), 0
                for view in views:
                    target[offset : offset + len(view)] = view
                    offset += len(view)
                self.slots[key] = slot
                self._stats.host_saves += 1
            return bytes(self._view(slot)) if copy else None

    def copy_out(self, key: bytes, targets: Sequence[memoryview]) -> bool:
        """Copies a block into `targets` (in order); False if it is not here."""
        with self._lock:
            slot = self.slots.get(key)
            if slot is None:
                return False
            self.slots.move_to_end(key)
            _scatter(self._view(slot), targets)
            return True

    def _view(self, slot: int) -> memoryview:
        return memoryview(self.buffer[slot].numpy()).cast("B")


class DiskTier:
    """Blocks as files under `directory/<namespace>`, at most `capacity` bytes of them."""

    def __init__(self, directory: str | Path, capacity: int, space: bytes, stats: TierStats):
        self.dir = Path(directory) / space.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self._stats = stats
        self._lock = threading.Lock()
        self.files: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self.num_bytes = 0
        found = []
        for path in self.dir.iterdir():
            if path.suffix != SUFFIX:
                path.unlink(missing_ok=True)  # a write cut short by a crash or a kill
                continue
            try:
                stat = path.stat()
                found.append((stat.st_mtime_ns, bytes.fromhex(path.stem), stat.st_size))
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
        for _, key, size in sorted(found):  # oldest first: the first evicted
            self.files[key] = size
            self.num_bytes += size
        self._evict()

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self.files

    def path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}{SUFFIX}"

    def write(self, key: bytes, data: bytes) -> None:
        """Writes a block atomically (a temporary file renamed into place)."""
        if key in self:
            return
        path = self.path(key)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        header = _HEADER.pack(MAGIC, key, len(data), zlib.crc32(data))
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            logger.warning("KV block not written to %s: %s", path, exc)
            return
        with self._lock:
            self.files[key] = len(header) + len(data)
            self.num_bytes += len(header) + len(data)
            self._stats.disk_writes += 1
            self._evict()

    def read(self, key: bytes, length: int) -> bytes | None:
        """A block's bytes, or None if absent; a damaged file is deleted (None)."""
        with self._lock:
            if key not in self.files:
                return None
            self.files.move_to_end(key)
        path = self.path(key)
        try:
            raw = path.read_bytes()
        except OSError:
            self._drop(key)
            return None
        if len(raw) >= _HEADER.size:
            magic, stored_key, size, crc = _HEADER.unpack_from(raw)
            data = raw[_HEADER.size :]
            if (magic, stored_key, size) == (MAGIC, key, length) == (MAGIC, key, len(data)):
                if zlib.crc32(data) == crc:
                    return data
        logger.warning("KV block file %s is damaged; it is dropped", path)
        self._stats.disk_corrupt += 1
        self._drop(key)
        return None

    def _drop(self, key: bytes) -> None:
        with self._lock:
            size = self.files.pop(key, None)
            if size is not None:
                self.num_bytes -= size
        self.path(key).unlink(missing_ok=True)

    def _evict(self) -> None:
        """Oldest files out until within capacity (lock held)."""
        while self.num_bytes > self.capacity and self.files:
            key, size = self.files.popitem(last=False)
            self.num_bytes -= size
            self.path(key).unlink(missing_ok=True)
            self._stats.disk_evictions += 1


def _scatter(source: memoryview, targets: Sequence[memoryview]) -> None:
    offset = 0
    for target in targets:
        target[:] = source[offset : offset + len(target)]
        offset += len(target)


class TieredStore:
    """The tiers of one engine: saves blocks out of its KV tensors, loads them back."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        identity: str,
        host_bytes: int | None,
        disk_dir: str | None,
        disk_bytes: int,
    ) -> None:
        self.kv_caches = kv_caches
        self.block_bytes = block_bytes(kv_caches)
        self.space = namespace(identity)
        self.stats = TierStats()
        self.host = HostTier(host_bytes, self.block_bytes, self.stats) if host_bytes else None
        self.disk = DiskTier(disk_dir, disk_bytes, self.space, self.stats) if disk_dir else None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ember-kv-disk")
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ember-kv-tier")
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()

    def close(self) -> None:
        self._writer.shutdown(wait=True)  # queued writes finish: a restart finds them
        self._loader.shutdown(wait=False, cancel_futures=True)

    def key(self, block_hash: bytes) -> bytes:
        return hashlib.sha256(self.space + block_hash).digest()[:16]

    def has(self, block_hash: bytes) -> bool:
        key = self.key(block_hash)
        return (self.host is not None and key in self.host) or (
            self.disk is not None and key in self.disk
        )

    def save(self, blocks: Iterable[tuple[bytes, int]]) -> None:
        """Copies (block hash, block id) pairs not yet stored out of the KV tensors (call
        between steps, before the blocks are freed); disk writes go on in the background."""
        for block_hash, block_id in blocks:
            key = self.key(block_hash)
            on_disk = self.disk is None or key in self.disk
            if self.host is not None:
                if key in self.host and on_disk:
                    continue
                data = self.host.put(key, chunks(self.kv_caches, [block_id]), copy=not on_disk)
            elif on_disk:
                continue
            else:
                data = b"".join(chunks(self.kv_caches, [block_id]))
            if not on_disk:
                self._queue_write(key, data)

    def _queue_write(self, key: bytes, data: bytes) -> None:
        with self._pending_lock:
            if self._pending_bytes + len(data) > MAX_PENDING_WRITE_BYTES:
                self.stats.disk_writes_dropped += 1
                return
            self._pending_bytes += len(data)
        self._writer.submit(self._write, key, data)

    def _write(self, key: bytes, data: bytes) -> None:
        try:
            self.disk.write(key, data)
        finally:
            with self._pending_lock:
                self._pending_bytes -= len(data)

    def flush(self) -> None:
        """Waits for the disk writes queued so far."""
        self._writer.submit(lambda: None).result()

    def load(self, blocks: Sequence[tuple[bytes, int]]) -> Future:
        """Copies (block hash, block id) pairs from the tiers into the KV tensors in a
        background thread; the future gives the bytes loaded or raises StoreMiss."""
        return self._loader.submit(self._load, list(blocks))

    def _load(self, blocks: list[tuple[bytes, int]]) -> int:
        for block_hash, block_id in blocks:
            key = self.key(block_hash)
            targets = list(chunks(self.kv_caches, [block_id]))
            if self.host is not None and self.host.copy_out(key, targets):
                self.stats.host_hits += 1
                continue
            data = self.disk.read(key, self.block_bytes) if self.disk is not None else None
            if data is None:
                raise StoreMiss(f"KV block {key.hex()} is no longer stored")
            _scatter(memoryview(data), targets)
            self.stats.disk_hits += 1
            if self.host is not None:  # the next turn finds it in memory
                self.host.put(key, [memoryview(data)])
        self.stats.bytes_loaded += len(blocks) * self.block_bytes
        return len(blocks) * self.block_bytes
