"""What a disaggregated request carries about its KV, from prefill worker to router to
decode worker (msgspec structs; over HTTP they travel as the `kv_transfer_params` JSON
object, opaque to the router).

    client -> router -> prefill worker   {"do_remote_decode": true}
    prefill worker -> router              RemotePrefill: where its prompt blocks wait,
                                          the first token, the prefix-cache hit count
    router -> decode worker               the same object, unchanged
"""

from __future__ import annotations

import msgspec


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
    first_logprobs: list[list[tuple[int, float]]] | None = None  # per first token
    num_cached_tokens: int = 0  # the prefill worker's prefix-cache hit
    node: str = ""  # the prefill host's identity (boot id); shared memory needs the same
    shm_path: str | None = None  # the prefill worker's KV cache file, when in shared memory
    mooncake_session: str | None = None  # its Mooncake Transfer Engine, when it runs one
    kv_addrs: list[int] | None = None  # ... and each layer's KV tensor address there


class KVTransferParams(msgspec.Struct, forbid_unknown_fields=True):
    """The part of an engine request about KV that comes from, or goes to, another worker."""

    do_remote_decode: bool = False  # prefill only: hold the blocks for a decode worker
    remote_prefill: RemotePrefill | None = None  # decode: fetch the prompt's blocks from here


def decode_params(value: object) -> KVTransferParams:
    """Checks a request's `kv_transfer_params` object; ValueError names what is wrong."""
    try:
        return msgspec.convert(value, KVTransferParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"kv_transfer_params: {exc}") from None
