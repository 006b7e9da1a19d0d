"""The Mooncake Transfer Engine as an optional KV transport (`--kv-transport mooncake`).

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

from collections.abc import Sequence

import torch

from ember.kv import wire
from ember.kv.params import RemotePrefill
from ember.kv.transport import KVTransferError, Transport, joint_runs

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
        block = dst_caches[0][0, 0].numel() * dst_caches[0].element_size()  # one part's
        dst_blocks = dst_caches[0].shape[1]
        for layer, base in zip(dst_caches, remote.kv_addrs, strict=True):
            for kv in range(layer.shape[0]):
                for src, dst, count in joint_runs(src_ids, dst_ids):
                    local.append(layer.data_ptr() + (kv * dst_blocks + dst) * block)
                    peer.append(base + (kv * remote.num_blocks + src) * block)
                    lengths.append(count * block)
        return local, peer, lengths

    def close(self) -> None:
        self._engine = None
