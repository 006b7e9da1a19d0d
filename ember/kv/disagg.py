"""Prefill/decode disaggregation: the `disagg` KV connector and its worker half.

Scheduler half (`DisaggConnector`, engine thread): a decode request whose prompt KV is on
a prefill worker (`kv_transfer_params.remote_prefill`) claims the prompt tokens past its
local hit and loads them; a prefill request that asked for it (`do_remote_decode`) and
stopped at its one-token limit has its blocks held for the decode worker (`hold`) until
the transfer is released or times out (`collect`).

Worker half (`KVConnectorWorker`): moves bytes. On a prefill worker it runs the KV
endpoint (`server.KVTransferServer`) over the engine's KV tensors; on any worker it runs
loads in background threads through a transport and reports which finished, so the
engine keeps decoding other requests while a prompt's blocks arrive.

A model over ranks: the tensors that move are every rank's (ember.kv.layout), one per
distinct piece; a decode worker whose ranks split the KV as the prefill worker's do takes
them tensor to tensor, one split otherwise reshards them on arrival. Copies of a piece on
other ranks (shared KV heads, MLA's latent) move once and are copied here.

A decode request's life: admitted with its local prefix-cache hit -> blocks allocated for
the rest of the prompt (not yet findable by hash) -> WAITING_FOR_KV while a thread fetches
only those blocks -> on success its prompt counts as computed and its blocks become
findable; on failure (refused, timed out, corrupt) its blocks are freed and it waits
again to recompute the prompt like any request. An abort during a load frees the blocks
once the load thread is done with them.
"""

from __future__ import annotations

import logging
import secrets
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

from ember import envs
from ember.kv.buffers import block_bytes, chunks, node_id
from ember.kv.connector import ConnectorContext, KVConnector
from ember.kv.layout import WorkerKV, reshard, staging
from ember.kv.params import RemotePrefill
from ember.kv.server import HeldTransfers, KVTransferServer
from ember.kv.transport import KVTransferError, ShmTransport, Transport, make_transport

logger = logging.getLogger("ember.kv")


class KVConnectorWorker:
    """Moves blocks: serves held ones (prefill) and fetches remote ones (any role)."""

    def __init__(
        self,
        kv: WorkerKV,
        *,
        role: str,
        transport: str,
        secret: bytes | None,
        host: str,
        port: int,
        timeout: float,
        checksum: bool,
        fake_fault: str | None = None,
    ) -> None:
        self.kv = kv
        self.kv_caches = kv_caches = kv.tensors  # the tensors that move (one per piece)
        self.block_bytes = block_bytes(kv_caches)
        self.num_blocks = kv_caches[0].shape[1] if kv_caches else 0
        self.transport_name = transport
        self.checksum = checksum
        self.holds = HeldTransfers()
        self.server: KVTransferServer | None = None
        self._transports: dict[str, Transport] = {}
        self._secret = secret or b""
        self._timeout = timeout
        self._host = host
        self._fake_fault = fake_fault
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ember-kv-load")
        if role == "prefill":
            if not secret:
                raise ValueError(
                    "a prefill worker needs the cluster's secret: set EMBER_CLUSTER_SECRET "
                    "(ember up sets it for its workers)"
                )
            self.server = KVTransferServer(kv_caches, self.holds, secret, host, port)
        self.mooncake = None  # a prefill worker's Mooncake endpoint, when that is the transport
        if role == "prefill" and transport == "mooncake":
            from ember.kv.mooncake import MooncakeEndpoint

            self.mooncake = MooncakeEndpoint(kv_caches, host)
        self.node = node_id()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for transport in self._transports.values():
            transport.close()
        if self.mooncake is not None:
            self.mooncake.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def transport_for(self, remote: RemotePrefill, direct: bool = True) -> Transport:
        """`direct`: blocks land in our tensors as they are (else in staging tensors,
        which a Mooncake engine has not registered: they come over TCP)."""
        name = self.transport_name
        if name == "auto":
            name = "shm" if ShmTransport.usable(remote) else "tcp"
        elif name == "mooncake" and not direct:
            name = "tcp"
        transport = self._transports.get(name)
        if transport is None:
            transport = make_transport(
                name, self._secret, self._timeout, self._fake_fault, self._host
            )
            self._transports[name] = transport
        return transport

    def start_load(self, remote: RemotePrefill, src_ids: list[int], dst_ids: list[int]) -> Future:
        return self._pool.submit(self._load, remote, src_ids, dst_ids)

    def release_remote(self, remote: RemotePrefill) -> None:
        """Gives a remote transfer back without reading it (best effort, in the background)."""
        self._pool.submit(self._release, remote)

    def _load(self, remote: RemotePrefill, src_ids: list[int], dst_ids: list[int]) -> int:
        """Fetches the blocks into ours; by way of staging tensors when the prefill
        worker's ranks split the KV otherwise (ember.kv.layout); then fills replicas."""
        if not src_ids:
            self._release(remote)
            return 0
        try:
            pieces = remote.pieces()
            plan = self.kv.check_sender(pieces, remote.block_bytes)
            targets, target_ids = self.kv_caches, dst_ids
            if plan is not None:
                targets = staging(pieces, self.kv_caches[0], len(src_ids))
                target_ids = list(range(len(src_ids)))
            transport = self.transport_for(remote, direct=plan is None)
            num_bytes, crc = transport.fetch(remote, src_ids, targets, target_ids, self.checksum)
        except BaseException:
            self._release(remote)  # best effort: the prefill worker need not wait it out
            raise
        if crc is not None:
            local = 0
            for view in chunks(targets, target_ids):
                local = zlib.crc32(view, local)
            if local != crc:
                raise KVTransferError("the received blocks do not match the sender's checksum")
        if plan is not None:
            reshard(targets, plan, self.kv_caches, dst_ids)
        self.kv.fill_replicas(dst_ids)
        return num_bytes

    def _release(self, remote: RemotePrefill) -> None:
        try:
            self.transport_for(remote).release(remote)
        except (OSError, KVTransferError) as exc:
            logger.info("could not release transfer %s (%s); it expires", remote.transfer_id, exc)


class DisaggConnector(KVConnector):
    """Loads prompts a prefill worker computed; holds prefills for decode workers."""

    name = "disagg"

    def __init__(
        self, worker: KVConnectorWorker, block_size: int, hold_timeout: float, stats=None
    ) -> None:
        super().__init__(stats)
        self.worker = worker
        self.block_size = block_size
        self.hold_timeout = hold_timeout
        self._held_by_request: dict[str, str] = {}  # request id -> transfer id
        self._held: dict[str, str] = {}  # transfer id -> request id

    def close(self) -> None:
        self.worker.close()

    # -- decode side --------------------------------------------------------------------

    @staticmethod
    def remote(request) -> RemotePrefill | None:
        params = request.kv_transfer
        return None if params is None else params.remote_prefill

    def external_tokens(self, request, num_local_hit: int) -> int:
        remote = self.remote(request)
        return 0 if remote is None else max(remote.num_tokens - num_local_hit, 0)

    def start_load(self, request, block_ids: list[int], num_local_hit: int) -> None:
        """Fetches the prompt's blocks from `num_local_hit` on into this request's blocks."""
        remote = self.remote(request)
        first = num_local_hit // self.block_size
        num_blocks = -(-remote.num_tokens // self.block_size)
        src, dst = remote.block_ids[first:num_blocks], block_ids[first:num_blocks]
        self._track(request, self.worker.start_load(remote, src, dst))

    def release_unused(self, request) -> None:
        """The prompt's KV was all here already: give the remote transfer back."""
        remote = self.remote(request)
        if remote is not None:
            self.worker.release_remote(remote)
            request.kv_transfer = None

    def cached_tokens(self, request, num_local_hit: int) -> int | None:
        """A handed-over prompt reports the prefill worker's prefix-cache hit."""
        remote = self.remote(request)
        return None if remote is None else remote.num_cached_tokens

    # -- prefill side -------------------------------------------------------------------

    def request_finished(self, request, block_ids: list[int], at_length: bool):
        return self.hold(request, block_ids) if at_length else None

    def hold(self, request, block_ids: list[int]) -> RemotePrefill | None:
        """Holds a finished prefill's blocks for a decode worker, if it asked for that and
        stopped only at its one-token limit; the params for the decode worker, or None."""
        params = request.kv_transfer
        server = self.worker.server
        if params is None or not params.do_remote_decode or server is None:
            return None
        num_tokens = request.num_prompt_tokens
        num_blocks = -(-num_tokens // self.block_size)
        mooncake = self.worker.mooncake
        transfer_id = f"{request.request_id}:{secrets.token_hex(6)}"
        held = list(block_ids[:num_blocks])
        self.worker.holds.add(transfer_id, held, self.hold_timeout)
        self._held_by_request[request.request_id] = transfer_id
        self._held[transfer_id] = request.request_id
        return RemotePrefill(
            host=server.host,
            port=server.port,
            transfer_id=transfer_id,
            block_ids=held,
            num_tokens=num_tokens,
            block_size=self.block_size,
            block_bytes=self.worker.block_bytes,
            num_blocks=self.worker.num_blocks,
            first_token_ids=request.output_token_ids,
            kv_pieces=[tuple(piece) for piece in self.worker.kv.pieces],
            num_cached_tokens=max(request.num_cached_tokens, 0),
            node=self.worker.node,
            shm_path=self.worker.kv.shm_path,
            shm_offsets=self.worker.kv.shm_offsets,
            mooncake_session=mooncake.session if mooncake else None,
            kv_addrs=mooncake.kv_addrs if mooncake else None,
        )

    def drop_hold(self, request_id: str) -> None:
        """The frontend will not hand this prefill over (e.g. a stop string ended it)."""
        transfer_id = self._held_by_request.get(request_id)
        if transfer_id is not None:
            self.worker.holds.release(transfer_id)

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def bytes_sent(self) -> int:
        server = self.worker.server
        return server.num_bytes_sent if server is not None else 0

    def collect(self) -> list[str]:
        """Transfer ids whose held blocks may be freed now."""
        freed = self.worker.holds.collect()
        for transfer_id in freed:
            request_id = self._held.pop(transfer_id)
            if self._held_by_request.get(request_id) == transfer_id:
                del self._held_by_request[request_id]
        self.stats.holds_expired = self.worker.holds.num_expired
        return freed


def make_disagg(context: ConnectorContext) -> DisaggConnector | None:
    """None where the engine's KV is out of reach (a mixed worker over ranks)."""
    if context.kv is None:
        return None
    config = context.config
    worker = KVConnectorWorker(
        context.kv,
        role=config.kv_role,
        transport=config.kv_transport,
        secret=envs.cluster_secret(),
        host=config.kv_host,
        port=config.kv_port,
        timeout=config.kv_load_timeout,
        checksum=config.kv_checksum,
        fake_fault=config.kv_fake_fault,
    )
    return DisaggConnector(worker, config.block_size, config.kv_hold_timeout, context.stats)
