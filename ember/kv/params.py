"""What a disaggregated request carries about its KV, from prefill worker to router to
decode worker (msgspec structs; over HTTP they travel as the `kv_transfer_params` JSON
object, opaque to the router).

    client -> router -> prefill worker   {"do_remote_decode": true}
    prefill worker -> router              RemotePrefill: where its prompt blocks wait,
                                          the first token, the prefix-cache hit count
    router -> decode worker               the same object, unchanged

The prefill worker signs what it hands over with the cluster secret (`ember.cluster`);
a decode worker checks the signature and the shape of the object before anything else,
so no field of it (an address to connect to, block ids, token ids) ever comes from a
client. Only a cluster's router may send `kv_transfer_params` at all.
"""

from __future__ import annotations

import msgspec

from ember import cluster
from ember.kv.layout import MAX_PIECES, Piece

MAX_FIRST_TOKENS = 16  # tokens a prefill may hand over with its KV (it sends one today)


class RemotePrefill(msgspec.Struct, forbid_unknown_fields=True):
    """A finished prefill whose blocks wait on its worker to be fetched (or released)."""

    host: str  # the prefill worker's KV endpoint
    port: int
    transfer_id: str
    block_ids: list[int]  # the prompt's blocks on the prefill worker, in order
    num_tokens: int  # prompt tokens whose KV those blocks hold
    block_size: int
    block_bytes: int  # bytes of one block over all layers (a layout check)
    num_blocks: int  # blocks in the prefill worker's KV cache (its tensors' layout)
    first_token_ids: list[int]  # sampled by the prefill worker, already part of the output
    # what each KV tensor sent holds, in the order sent: (layer, first KV head, end KV
    # head) of the model's (ember.kv.layout: a decode worker split otherwise reshards)
    kv_pieces: list[tuple[int, int, int]]
    first_logprobs: list[list[tuple[int, float]]] | None = None  # per first token
    num_cached_tokens: int = 0  # the prefill worker's prefix-cache hit
    node: str = ""  # the prefill host's identity (boot id); shared memory needs the same
    shm_path: str | None = None  # the prefill worker's KV cache file, when in shared memory
    shm_offsets: list[int] | None = None  # ... and where each KV tensor sent starts in it
    mooncake_session: str | None = None  # its Mooncake Transfer Engine, when it runs one
    kv_addrs: list[int] | None = None  # ... and each KV tensor's address there
    signature: str = ""  # the prefill worker's HMAC over every other field

    def check(self) -> None:
        """Checks the object is self-consistent; ValueError names what is wrong. (Whether it
        fits this worker, its vocabulary and KV layout, the engine core checks.)"""
        _check(0 < self.port < 65536, f"port {self.port} is not a TCP port")
        _check(0 < len(self.transfer_id) <= 256, "transfer_id must have 1-256 characters")
        _check(self.num_tokens >= 1, "num_tokens must be >= 1")
        _check(self.block_size >= 1 and self.num_blocks >= 1, "block_size and num_blocks >= 1")
        _check(
            len(self.block_ids) == -(-self.num_tokens // self.block_size),
            "block_ids do not cover num_tokens",
        )
        _check(
            all(0 <= b < self.num_blocks for b in self.block_ids),
            f"block_ids must be in [0, {self.num_blocks})",
        )
        _check(
            0 < len(self.first_token_ids) <= MAX_FIRST_TOKENS
            and all(t >= 0 for t in self.first_token_ids),
            f"first_token_ids must be 1-{MAX_FIRST_TOKENS} token ids",
        )
        _check(
            self.first_logprobs is None or len(self.first_logprobs) == len(self.first_token_ids),
            "first_logprobs must have one entry per first token",
        )
        _check(0 <= self.num_cached_tokens <= self.num_tokens, "num_cached_tokens out of range")
        _check(
            0 < len(self.kv_pieces) <= MAX_PIECES
            and all(layer >= 0 and 0 <= start < stop for layer, start, stop in self.kv_pieces),
            f"kv_pieces must be 1-{MAX_PIECES} (layer, head start, head stop) with start < stop",
        )
        for name in ("shm_offsets", "kv_addrs"):
            values = getattr(self, name)
            _check(
                values is None or (len(values) == len(self.kv_pieces) and min(values) >= 0),
                f"{name} must have one offset or address >= 0 per KV piece",
            )

    def pieces(self) -> list[Piece]:
        return [Piece(*piece) for piece in self.kv_pieces]

    def payload(self) -> bytes:
        """The canonical bytes the signature covers (every field but the signature)."""
        return _msgpack(msgspec.structs.replace(self, signature=""))

    def signed(self, secret: bytes) -> RemotePrefill:
        return msgspec.structs.replace(self, signature=cluster.sign(secret, self.payload()))


class KVTransferParams(msgspec.Struct, forbid_unknown_fields=True):
    """The part of an engine request about KV that comes from, or goes to, another worker."""

    do_remote_decode: bool = False  # prefill only: hold the blocks for a decode worker
    remote_prefill: RemotePrefill | None = None  # decode: fetch the prompt's blocks from here


_msgpack = msgspec.msgpack.Encoder().encode


def decode_params(value: object, secret: bytes | None) -> KVTransferParams:
    """A request's `kv_transfer_params`, checked: its types, a `remote_prefill`'s signature
    by a prefill worker of this cluster (`secret`), and its shape. ValueError says what is
    wrong, prefixed with the parameter's name."""
    try:
        params = msgspec.convert(value, KVTransferParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"kv_transfer_params: {exc}") from None
    remote = params.remote_prefill
    if remote is not None:
        if not cluster.verify(secret, remote.payload(), remote.signature):
            raise ValueError(
                "kv_transfer_params: remote_prefill is not signed by a prefill worker of "
                "this cluster"
            )
        remote.check()
    return params


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"kv_transfer_params: remote_prefill: {message}")
