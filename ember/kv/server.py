"""The KV endpoint of a prefill worker: decode workers fetch finished prompts' blocks here.

Life cycle of a transfer: when a prefill finishes, the engine *holds* the prompt's
blocks under a transfer id (`HeldTransfers.add`) instead of freeing them. A decode
worker connects, proves it has the cluster secret, fetches the blocks it lacks (a
fetch *leases* them: they cannot expire while being read) and releases the transfer.
The engine thread frees released transfers, and those nobody claimed within the hold
timeout, on its next loop (`HeldTransfers.collect`). A decode worker that dies mid-way
costs at most the hold timeout, never blocks held forever.

The endpoint runs in threads of the engine process (socket I/O releases the GIL) and
only reads blocks that are held, which the engine never writes or reallocates.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import zlib
from dataclasses import dataclass

from ember.kv import wire
from ember.kv.buffers import chunks

logger = logging.getLogger("ember.kv")


@dataclass
class _Held:
    block_ids: frozenset[int]
    deadline: float
    leases: int = 0
    released: bool = False


class HeldTransfers:
    """Blocks held for decode workers, shared by the engine thread and the endpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self.num_expired = 0

    def add(self, transfer_id: str, block_ids: list[int], timeout: float) -> None:
        with self._lock:
            self._held[transfer_id] = _Held(frozenset(block_ids), time.monotonic() + timeout)

    def lease(self, transfer_id: str, block_ids: list[int]) -> str | None:
        """Takes a lease on some of a transfer's blocks; an error message if it cannot."""
        with self._lock:
            held = self._held.get(transfer_id)
            if held is None or held.released:
                return f"transfer {transfer_id!r} is unknown, expired or released"
            if not held.block_ids.issuperset(block_ids):
                return f"transfer {transfer_id!r} does not hold those blocks"
            held.leases += 1
            return None

    def unlease(self, transfer_id: str) -> None:
        with self._lock:
            held = self._held.get(transfer_id)
            if held is not None:
                held.leases -= 1

    def release(self, transfer_id: str) -> None:
        with self._lock:
            held = self._held.get(transfer_id)
            if held is not None:
                held.released = True

    def collect(self) -> list[str]:
        """Transfers whose blocks may be freed now (released, or expired and not leased)."""
        now = time.monotonic()
        with self._lock:
            done = [
                tid for tid, h in self._held.items()
                if h.leases == 0 and (h.released or h.deadline <= now)
            ]  # fmt: skip
            for tid in done:
                if not self._held.pop(tid).released:
                    self.num_expired += 1
        return done


class KVTransferServer:
    """Serves held blocks over TCP; one thread accepts, one per connection serves."""

    def __init__(self, kv_caches, holds: HeldTransfers, secret: bytes, host: str, port: int):
        self.kv_caches = kv_caches
        self.holds = holds
        self.secret = secret
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.num_bytes_sent = 0
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="ember-kv", daemon=True)
        self._thread.start()
        logger.info("KV endpoint on %s:%d", self.host, self.port)

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        wire.prepare(conn, 30.0)
        try:
            if not wire.authenticate_client(conn, self.secret):
                logger.warning("KV endpoint: a peer without the cluster secret was refused")
                return
            while True:
                message = wire.recv_client_message(conn)
                if isinstance(message, wire.Release):
                    self.holds.release(message.transfer_id)
                    wire.send_frame(conn, wire.FetchReply(ok=True))
                else:
                    self._fetch(conn, message)
        except (ConnectionError, OSError, ValueError):
            pass  # the peer hung up (or spoke nonsense): nothing of ours is left leased
        finally:
            conn.close()

    def _fetch(self, conn: socket.socket, fetch: wire.Fetch) -> None:
        error = self.holds.lease(fetch.transfer_id, fetch.block_ids)
        if error is not None:
            wire.send_frame(conn, wire.FetchReply(ok=False, error=error))
            return
        try:
            views = list(chunks(self.kv_caches, fetch.block_ids)) if fetch.send else []
            wire.send_frame(conn, wire.FetchReply(ok=True, num_bytes=sum(map(len, views))))
            wire.send_views(conn, views)
            self.num_bytes_sent += sum(map(len, views))
            if fetch.send and fetch.checksum:
                crc = 0
                for view in views:
                    crc = zlib.crc32(view, crc)
                wire.send_frame(conn, wire.Checksum(crc))
            if not fetch.send:  # shared memory: the lease lasts until the reader releases
                wire.recv_client_message(conn)
                self.holds.release(fetch.transfer_id)
                wire.send_frame(conn, wire.FetchReply(ok=True))
        finally:
            self.holds.unlease(fetch.transfer_id)
