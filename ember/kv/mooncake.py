"""Mooncake: the Transfer Engine as an optional KV transport (`--kv-transport mooncake`),
and Mooncake Store as the cluster tier below every worker's pool (`--kv-store
mooncake://MASTER`, `MooncakeStoreTier`).

Install: `pip install 'ember[mooncake]'` (mooncake-transfer-engine-non-cuda; the CUDA
build on GPU machines) and the Debian package `libibverbs1`, which it links even for TCP.
RDMA is used where the engine finds it; here it runs over TCP.

A prefill worker registers its KV tensors with its own Transfer Engine and advertises the
engine's session (host:port) and each layer's tensor address with every finished prefill.
A decode worker leases the blocks through the prefill worker's KV endpoint (which checks
the cluster secret), reads them with one batched one-sided read straight into its own
(registered) KV tensors, and releases them.

Caution: the Transfer Engine listens on all interfaces whatever address it is given, and
does not check the cluster secret itself: run it only on a trusted network (the tests run
it inside a loopback-only network namespace).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import torch

from ember.kv import wire
from ember.kv.params import RemotePrefill
from ember.kv.transport import KVTransferError, Transport, joint_runs

logger = logging.getLogger("ember.kv")

MAX_BATCH = 256  # reads per batched call (larger batches fail in the TCP transport)


def _engine(host: str):
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ValueError(
            "kv_transport mooncake needs `pip install mooncake-transfer-engine-non-cuda` "
            f"and the libibverbs1 system package ({exc})"
        ) from None
    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("the Mooncake Transfer Engine failed to start")
    return engine


def _register(engine, caches: Sequence[torch.Tensor]) -> None:
    for layer in caches:
        if engine.register_memory(layer.data_ptr(), layer.numel() * layer.element_size()) != 0:
            raise RuntimeError("the Mooncake Transfer Engine could not register KV memory")


class MooncakeEndpoint:
    """A prefill worker's side: its KV tensors, readable by decode workers' engines."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], host: str) -> None:
        self.engine = _engine(host)
        _register(self.engine, kv_caches)
        self.kv_caches = kv_caches
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.kv_addrs = [layer.data_ptr() for layer in kv_caches]

    def close(self) -> None:
        for layer in self.kv_caches:
            self.engine.unregister_memory(layer.data_ptr())


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(self, secret: bytes, timeout: float, host: str = "127.0.0.1") -> None:
        super().__init__(secret, timeout)
        self._host = host
        self._engine = None
        self._registered: set[int] = set()

    def fetch(self, remote, src_ids, dst_caches, dst_ids, checksum=False):
        if not remote.mooncake_session or not remote.kv_addrs:
            raise KVTransferError("the prefill worker runs no Mooncake Transfer Engine")
        engine = self._ready(dst_caches)
        local, peer, lengths = self._plan(remote, src_ids, dst_caches, dst_ids)
        with self._connect(remote) as sock:
            self._request(sock, wire.Fetch(remote.transfer_id, list(src_ids), send=False))
            for i in range(0, len(local), MAX_BATCH):
                part = slice(i, i + MAX_BATCH)
                rc = engine.batch_transfer_sync_read(
                    remote.mooncake_session, local[part], peer[part], lengths[part]
                )
                if rc != 0:
                    raise KVTransferError(f"Mooncake read failed (rc {rc})")
            self._release(sock, remote)
        return sum(lengths), None

    def _ready(self, caches: Sequence[torch.Tensor]):
        if self._engine is None:
            self._engine = _engine(self._host)
        if caches[0].data_ptr() not in self._registered:
            _register(self._engine, caches)
            self._registered.add(caches[0].data_ptr())
        return self._engine

    @staticmethod
    def _plan(remote: RemotePrefill, src_ids, dst_caches, dst_ids):
        """Local addresses, peer addresses and lengths: per layer, part by part (keys then
        values), per stretch of consecutive blocks on both sides."""
        local, peer, lengths = [], [], []
        for layer, base in zip(dst_caches, remote.kv_addrs, strict=True):
            block = layer[0, 0].numel() * layer.element_size()  # one part's
            dst_blocks = layer.shape[1]
            for kv in range(layer.shape[0]):
                for src, dst, count in joint_runs(src_ids, dst_ids):
                    local.append(layer.data_ptr() + (kv * dst_blocks + dst) * block)
                    peer.append(base + (kv * remote.num_blocks + src) * block)
                    lengths.append(count * block)
        return local, peer, lengths

    def close(self) -> None:
        self._engine = None


MAC_BYTES = 32  # HMAC-SHA256 of the key and the block, with the cluster secret
KEY_PREFIX = "ember-kv/"


def parse_store_url(url: str) -> str:
    """`mooncake://HOST:PORT` -> the master's `HOST:PORT` (ValueError naming kv_store)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "mooncake" or not parts.hostname or port is None or parts.path:
        raise ValueError(f"kv_store must be mooncake://HOST:PORT (the master's), got {url!r}")
    return parts.netloc


class MooncakeStoreTier:
    """The cluster tier: blocks in a Mooncake Store pool that every worker pointed at the
    same master shares (memory its clients mount, with the master's eviction).

    The store trusts anyone who can reach it, so each value is the block's bytes after an
    HMAC-SHA256 of (key, bytes) under the cluster secret: a value that was forged, truncated
    or written for another key is refused (and removed), and the request recomputes.
    Calls block in Mooncake's client; ember makes them from its writer and loader threads
    only, never from the step loop.
    """

    def __init__(self, url: str, secret: bytes | None, segment_bytes: int = 0,
                 host: str = "127.0.0.1") -> None:  # fmt: skip
        master = parse_store_url(url)
        if not secret:
            raise ValueError(
                "kv_store needs the cluster's secret to sign what it stores: set "
                "EMBER_CLUSTER_SECRET (ember up sets it for its workers)"
            )
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ValueError(
                "kv_store mooncake needs `pip install mooncake-transfer-engine-non-cuda` "
                f"and the libibverbs1 system package ({exc})"
            ) from None
        self._secret = secret
        self._store = MooncakeDistributedStore()
        # P2P handshake: no metadata server; local buffer for the client's own transfers
        rc = self._store.setup(host, "P2PHANDSHAKE", segment_bytes, 64 << 20, "tcp", "", master)
        if rc != 0:
            raise ValueError(f"kv_store: could not join the Mooncake Store at {master} (rc {rc})")
        self.master = master

    def close(self) -> None:
        self._store.close()

    @staticmethod
    def name(key: bytes) -> str:
        return KEY_PREFIX + key.hex()

    def _mac(self, key: bytes, data: bytes | memoryview) -> bytes:
        digest = hmac.new(self._secret, key, hashlib.sha256)
        digest.update(data)
        return digest.digest()

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys the store holds (one round trip to the master)."""
        if not keys:
            return []
        found = self._store.batch_is_exist([self.name(k) for k in keys])
        if any(flag < 0 for flag in found):
            raise OSError(f"the Mooncake Store at {self.master} did not answer a lookup")
        return [flag == 1 for flag in found]

    def put(self, key: bytes, data: bytes, pin_seconds: float = 0.0) -> bool:
        """Stores a block; `pin_seconds` > 0 soft-pins it (a session's: the master evicts
        it after unpinned blocks) for that long."""
        value = self._mac(key, data) + data
        if pin_seconds <= 0:
            return self._store.put(self.name(key), value) == 0
        from mooncake.store import ReplicateConfig, SoftPinAction

        config = ReplicateConfig()
        config.soft_pin_action = SoftPinAction.ENABLE
        config.soft_pin_ttl_ms = int(pin_seconds * 1000)
        return self._store.put(self.name(key), value, config) == 0

    def get(self, key: bytes, length: int) -> bytes | None:
        """The block's bytes; None if absent; b"" if they fail their MAC (then removed)."""
        raw = self._store.get(self.name(key))
        if not raw:
            return None
        data = memoryview(raw)[MAC_BYTES:]
        if len(raw) == MAC_BYTES + length and hmac.compare_digest(
            raw[:MAC_BYTES], self._mac(key, data)
        ):
            return bytes(data)
        logger.warning("KV block %s in the store fails its MAC; it is removed", key.hex())
        self._store.remove(self.name(key))
        return b""


def binary(name: str) -> str:
    """A Mooncake program shipped in its wheel (mooncake_master, mooncake_client)."""
    try:
        import mooncake
    except ImportError as exc:
        raise ValueError(
            f"--kv-store mooncake needs `pip install mooncake-transfer-engine-non-cuda` ({exc})"
        ) from None
    path = Path(mooncake.__file__).parent / name
    if not path.exists():
        raise ValueError(f"the installed Mooncake has no {name} program ({path})")
    return str(path)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def store_commands(memory: int) -> tuple[list[str], list[str], str]:
    """The command lines of a Mooncake Store on this machine: a master (bound to loopback)
    and a client process that holds `memory` bytes of the pool (so the blocks outlive any
    worker); and the master's address."""
    master_port = free_port()
    master = [
        binary("mooncake_master"),
        f"--rpc_port={master_port}",
        "--rpc_address=127.0.0.1",
        f"--metrics_port={free_port()}",
        "--metrics_host=127.0.0.1",
        "--enable_metric_reporting=false",  # else a status line every 10 s
    ]
    holder = [
        binary("mooncake_client"),
        "--host=127.0.0.1",
        f"--port={free_port()}",
        f"--global_segment_size={memory}",
        "--metadata_server=P2PHANDSHAKE",
        f"--master_server_address=127.0.0.1:{master_port}",
    ]
    return master, holder, f"127.0.0.1:{master_port}"


def wait_listening(port: int, timeout: float) -> None:
    """Until something accepts connections on 127.0.0.1:`port` (TimeoutError if not)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port}") from None
            time.sleep(0.1)
