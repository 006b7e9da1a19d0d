"""How blocks move from a prefill worker's endpoint into a decode worker's KV tensors.

Every transport pulls: `fetch(remote, src_ids, dst_caches, dst_ids)` copies the remote
blocks `src_ids` into the local blocks `dst_ids` and releases the transfer, returning the
bytes moved and, when asked, the sender's CRC-32 of them; `release(remote)` gives the
blocks back without reading them. Any failure raises (`KVTransferError` or an OSError);
the connector then falls back to recomputing the prompt.

- `TcpTransport`: one socket; the bytes land straight in the block buffers (recv_into).
- `ShmTransport`: same host; leases the blocks over the socket, copies them out of the
  prefill worker's shared-memory KV file with torch, releases.
- `FakeTransport`: for tests; wraps another and delays, drops, fails or corrupts.
"""

from __future__ import annotations

import abc
import contextlib
import os
import socket
import time
from collections.abc import Sequence

import torch

from ember.kv import wire
from ember.kv.buffers import SHM_DIR, chunks, map_shared, node_id
from ember.kv.params import RemotePrefill


class KVTransferError(RuntimeError):
    pass


class Transport(abc.ABC):
    """A way to pull blocks; every transport here leases and releases them over the
    prefill worker's KV endpoint (`_connect`), whatever carries the bytes."""

    name = "?"

    def __init__(self, secret: bytes, timeout: float) -> None:
        self.secret = secret
        self.timeout = timeout

    @abc.abstractmethod
    def fetch(
        self,
        remote: RemotePrefill,
        src_ids: Sequence[int],
        dst_caches: Sequence[torch.Tensor],
        dst_ids: Sequence[int],
        checksum: bool = False,
    ) -> tuple[int, int | None]:
        """Copies remote blocks `src_ids` into local `dst_ids`, then releases the transfer;
        returns (bytes moved, the sender's CRC-32 when `checksum` and it sends one)."""

    def release(self, remote: RemotePrefill) -> None:
        with self._connect(remote) as sock:
            self._release(sock, remote)

    def close(self) -> None:  # noqa: B027 - optional: most transports hold nothing
        """Lets go of what the transport keeps between fetches."""

    @contextlib.contextmanager
    def _connect(self, remote: RemotePrefill):
        sock = socket.create_connection((remote.host, remote.port), timeout=self.timeout)
        try:
            wire.prepare(sock, self.timeout)
            wire.authenticate_server(sock, self.secret)
            yield sock
        finally:
            sock.close()

    @staticmethod
    def _request(sock: socket.socket, message) -> wire.FetchReply:
        wire.send_frame(sock, message)
        reply = wire.recv_reply(sock)
        if not isinstance(reply, wire.FetchReply) or not reply.ok:
            error = getattr(reply, "error", "unexpected reply")
            raise KVTransferError(f"prefill worker refused: {error}")
        return reply

    def _release(self, sock: socket.socket, remote: RemotePrefill) -> None:
        self._request(sock, wire.Release(remote.transfer_id))


class TcpTransport(Transport):
    name = "tcp"

    def fetch(self, remote, src_ids, dst_caches, dst_ids, checksum=False):
        with self._connect(remote) as sock:
            fetch = wire.Fetch(remote.transfer_id, list(src_ids), send=True, checksum=checksum)
            reply = self._request(sock, fetch)
            views = list(chunks(dst_caches, dst_ids))
            if reply.num_bytes != sum(map(len, views)):
                raise KVTransferError(
                    f"block layouts differ: the prefill worker sends {reply.num_bytes} bytes "
                    f"for {len(src_ids)} blocks, this worker expects {sum(map(len, views))}"
                )
            wire.recv_views(sock, views)
            crc = None
            if checksum:
                message = wire.recv_reply(sock)
                if not isinstance(message, wire.Checksum):
                    raise KVTransferError("the prefill worker sent no checksum")
                crc = message.crc32
            self._release(sock, remote)
            return reply.num_bytes, crc


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, secret: bytes, timeout: float) -> None:
        super().__init__(secret, timeout)
        self._maps: dict[tuple, list[torch.Tensor]] = {}

    @staticmethod
    def usable(remote: RemotePrefill) -> bool:
        path = remote.shm_path or ""
        ours = os.path.dirname(path) == SHM_DIR and os.path.basename(path).startswith("ember-kv-")
        return ours and remote.node == node_id()

    def fetch(self, remote, src_ids, dst_caches, dst_ids, checksum=False):
        if not self.usable(remote):
            raise KVTransferError("the prefill worker's KV is not in shared memory on this host")
        src_caches = self._map(remote, dst_caches)
        with self._connect(remote) as sock:
            self._request(sock, wire.Fetch(remote.transfer_id, list(src_ids), send=False))
            num_bytes = copy_blocks(src_caches, src_ids, dst_caches, dst_ids)
            self._release(sock, remote)
        return num_bytes, None  # memory to memory on one host: nothing to check against

    def _map(self, remote: RemotePrefill, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The prefill worker's tensors that move, mapped from its file (shaped as `like`
        but for their blocks)."""
        key = (remote.shm_path, tuple(remote.kv_pieces), tuple(remote.shm_offsets or ()))
        caches = self._maps.get(key)
        if caches is None:
            if remote.shm_offsets is None or len(like) != len(remote.kv_pieces):
                raise KVTransferError("the prefill worker did not say where its KV lies")
            shapes = [(t.shape[0], remote.num_blocks, *t.shape[2:]) for t in like]  # its blocks
            try:
                caches = map_shared(remote.shm_path, shapes, remote.shm_offsets, like[0].dtype)
            except (OSError, ValueError) as exc:
                raise KVTransferError(str(exc)) from None
            self._maps[key] = caches
        return caches


def joint_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src first, dst first, count): stretches where both block lists run consecutively."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def copy_blocks(src_caches, src_ids, dst_caches, dst_ids) -> int:
    """Copies blocks between two engines' KV tensors; returns the bytes copied."""
    src = torch.tensor(list(src_ids), dtype=torch.long)
    dst = torch.tensor(list(dst_ids), dtype=torch.long)
    num_bytes = 0
    for src_layer, dst_layer in zip(src_caches, dst_caches, strict=True):
        for src_part, dst_part in zip(src_layer, dst_layer, strict=True):  # keys, values
            blocks = src_part.index_select(0, src)
            dst_part.index_copy_(0, dst, blocks)
            num_bytes += blocks.numel() * blocks.element_size()
    return num_bytes


class FakeTransport(Transport):
    """Wraps a transport and injects a fault: `delay:SECONDS`, `drop` (never answers;
    the fetch times out), `fail` (refused), or `corrupt` (bytes change in flight)."""

    name = "fake"

    def __init__(self, inner: Transport, fault: str | None) -> None:
        super().__init__(inner.secret, inner.timeout)
        self.inner = inner
        self.fault = fault or ""

    def fetch(self, remote, src_ids, dst_caches, dst_ids, checksum=False):
        fault = self.fault
        if fault.startswith("delay:"):
            time.sleep(float(fault.split(":", 1)[1]))
        elif fault == "drop":
            time.sleep(self.timeout)
            raise TimeoutError("fake transport: the transfer was dropped")
        elif fault == "fail":
            raise KVTransferError("fake transport: the transfer failed")
        num_bytes, crc = self.inner.fetch(remote, src_ids, dst_caches, dst_ids, checksum)
        if fault == "corrupt":
            view = next(chunks(dst_caches, dst_ids[:1]))
            view[0] ^= 0xFF
        return num_bytes, crc


def make_transport(
    name: str, secret: bytes, timeout: float, fault: str | None, host: str = "127.0.0.1"
) -> Transport:
    if name == "tcp":
        return TcpTransport(secret, timeout)
    if name == "shm":
        return ShmTransport(secret, timeout)
    if name == "fake":
        return FakeTransport(TcpTransport(secret, timeout), fault)
    if name == "mooncake":
        from ember.kv.mooncake import MooncakeTransport

        return MooncakeTransport(secret, timeout, host)
    raise ValueError(f"kv_transport must be auto, tcp, shm, mooncake or fake; got {name!r}")
