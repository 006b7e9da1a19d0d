"""The disk tier: one file per block, `<dir>/<namespace>/<key>.kvb` (`.kvs` for an agent
session's block), a header (magic, key, length, CRC-32 of the bytes) and the block's
bytes, written to a temporary file and renamed into place, so a reader sees a whole
block or none; a file whose header or checksum does not match is deleted on read. The
files outlive the process: a restarted worker indexes them (oldest first, for LRU
eviction) and serves warm."""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.kv.tiers import TierCounters

logger = logging.getLogger("ember.kv")

MAGIC = b"EMBERKV1"
_HEADER = struct.Struct("<8s16sQI")  # magic, key, length, crc32
SUFFIX = ".kvb"
SESSION_SUFFIX = ".kvs"  # a session's block, kept for the session TTL


class DiskTier:
    """Blocks as files under `directory/<namespace>`, at most `capacity` bytes of them.

    Blocks of agent sessions (`retain`) are files with SESSION_SUFFIX, evicted only after
    every other block, or once `session_ttl` seconds have passed since they were last
    saved (their mtime, so a restart keeps the promise)."""

    def __init__(
        self,
        directory: str | Path,
        capacity: int,
        space: bytes,
        stats: TierCounters,
        session_ttl: float = 0.0,
    ) -> None:
        self.dir = Path(directory) / space.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.given = capacity
        self.capacity = capacity  # lowered to what fits while the file system is full
        self.session_ttl = session_ttl
        self._stats = stats
        self._lock = threading.Lock()
        self._warned = -60.0  # when a failed write was last logged (time.monotonic())
        self.files: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self.kept: OrderedDict[bytes, int] = OrderedDict()  # the sessions' blocks, LRU first
        self.kept_until: dict[bytes, float] = {}  # and when their TTL ends (time.time())
        self.num_bytes = 0
        found = []
        for path in self.dir.iterdir():
            if path.suffix not in (SUFFIX, SESSION_SUFFIX):
                path.unlink(missing_ok=True)  # a write cut short by a crash or a kill
                continue
            try:
                stat = path.stat()
                key = bytes.fromhex(path.stem)
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime_ns, key, stat.st_size, path.suffix == SESSION_SUFFIX))
        for mtime, key, size, kept in sorted(found):  # oldest first: the first evicted
            (self.kept if kept else self.files)[key] = size
            self.num_bytes += size
            if kept:
                self.kept_until[key] = mtime / 1e9 + session_ttl
        self._evict()

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self.files or key in self.kept

    def path(self, key: bytes, kept: bool | None = None) -> Path:
        if kept is None:
            kept = key in self.kept
        return self.dir / f"{key.hex()}{SESSION_SUFFIX if kept else SUFFIX}"

    def write(self, key: bytes, data: bytes, retain: bool = False) -> None:
        """Writes a block atomically (a temporary file renamed into place); one already
        here is only kept longer if `retain` (its TTL starts again). A file system that
        is full (or over quota) before `capacity` is reached lowers `capacity` to what it
        holds, so older blocks make room for newer ones; each write that then finds room
        raises it again by that block, back up to what the tier was given."""
        if key in self:
            if retain:
                self._retain(key)
            return
        path = self.path(key, retain)
        header = _HEADER.pack(MAGIC, key, len(data), zlib.crc32(data))
        size = len(header) + len(data)
        for attempt in range(2):
            try:
                self._write_file(path, header, data)
                break
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT) and attempt == 0:
                    self._full(size)  # room made: once more
                    continue
                self._stats.write_errors += 1
                if time.monotonic() - self._warned >= 60:  # a broken disk: one line a minute
                    self._warned = time.monotonic()
                    logger.warning("KV block not written to %s: %s (%d writes failed so far)",
                                   path, exc, self._stats.write_errors)  # fmt: skip
                return
        with self._lock:
            if attempt == 0 and self.capacity < self.given:  # room again (freed elsewhere)
                self.capacity = min(self.capacity + size, self.given)
            (self.kept if retain else self.files)[key] = size
            self.num_bytes += size
            if retain:
                self.kept_until[key] = time.time() + self.session_ttl
            self._stats.writes += 1
            self._evict()

    @staticmethod
    def _write_file(path: Path, header: bytes, data: bytes) -> None:
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _full(self, size: int) -> None:
        """The file system is full: the tier keeps at most what it holds now, less one
        block's room for the block being written."""
        with self._lock:
            capacity = max(self.num_bytes - size, 0)
            if capacity < self.capacity:
                if self.capacity == self.given:
                    logger.warning("the disk under %s is full: the disk tier keeps what fits "
                                   "(%d bytes now; it was given %d)", self.dir, capacity,
                                   self.given)  # fmt: skip
                self.capacity = capacity
            self._evict()

    def _retain(self, key: bytes) -> None:
        """Marks a stored block as a session's, or starts its TTL again."""
        now = time.time()
        with self._lock:
            until = self.kept_until.get(key)
            if until is not None and until - now > self.session_ttl / 2:
                return  # renewed recently enough: spare the disk a write
            try:
                if until is None:
                    os.replace(self.path(key, False), self.path(key, True))
                else:
                    os.utime(self.path(key, True))
            except OSError:
                return
            if until is None:
                self.kept[key] = self.files.pop(key)
            self.kept.move_to_end(key)
            self.kept_until[key] = now + self.session_ttl

    def read(self, key: bytes, length: int) -> bytes | None:
        """A block's bytes, or None if absent; a damaged file is deleted (None)."""
        with self._lock:
            lru = self.kept if key in self.kept else self.files
            if key not in lru:
                return None
            lru.move_to_end(key)
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
        self._stats.corrupt += 1
        self._drop(key)
        return None

    def _drop(self, key: bytes) -> None:
        with self._lock:
            path = self.path(key)
            size = self.files.pop(key, None) or self.kept.pop(key, None)
            self.kept_until.pop(key, None)
            if size is not None:
                self.num_bytes -= size
        path.unlink(missing_ok=True)

    def _evict(self) -> None:
        """Files out until within capacity (lock held): a session's block whose TTL has
        passed, else the least recently used of the others, else of the sessions'."""
        now = time.time()
        while self.num_bytes > self.capacity and (self.files or self.kept):
            oldest_kept = next(iter(self.kept), None)
            expired = oldest_kept is not None and self.kept_until[oldest_kept] <= now
            lru = self.kept if expired or not self.files else self.files
            victim = next(iter(lru))
            path = self.path(victim)
            self.num_bytes -= lru.pop(victim)
            self.kept_until.pop(victim, None)
            path.unlink(missing_ok=True)
            self._stats.evictions += 1
