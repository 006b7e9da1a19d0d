"""The KV endpoint's wire protocol: length-prefixed msgpack frames, then raw block bytes.

    server -> client   16-byte nonce
    client -> server   HMAC-SHA256(secret, nonce), its own 16-byte nonce
                                                           (wrong: the server hangs up)
    server -> client   HMAC-SHA256(secret, "server" + the client's nonce)
                                                           (wrong: the client hangs up)
    client -> server   Fetch(transfer_id, block_ids, send, checksum)
    server -> client   FetchReply(ok, error, num_bytes)   then, when `send`, the bytes of
                                                           the blocks (buffers.chunks order)
                                                           and a Checksum frame if asked
    client -> server   Release(transfer_id)               the blocks may be freed
    server -> client   FetchReply(ok)

The secret never crosses the wire; both ends of every connection prove they hold it (a
decode worker never trusts an endpoint that does not: it maps and reads what that
endpoint's answers point at).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

import msgspec

NONCE_BYTES = 16
_LEN = struct.Struct("!I")
MAX_FRAME = 64 << 20
IOV_BATCH = 512  # buffers per sendmsg / recvmsg_into (Linux allows 1024)
SOCKET_BUFFER = 4 << 20


class Fetch(msgspec.Struct, tag="fetch"):
    transfer_id: str
    block_ids: list[int]  # a subset of the transfer's blocks, in the order wanted
    send: bool = True  # False: only lease them (the reader maps shared memory itself)
    checksum: bool = False


class Release(msgspec.Struct, tag="release"):
    transfer_id: str


class FetchReply(msgspec.Struct, tag="reply"):
    ok: bool
    error: str = ""
    num_bytes: int = 0


class Checksum(msgspec.Struct, tag="crc"):
    crc32: int


ClientMessage = Fetch | Release
_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_reply_decoder = msgspec.msgpack.Decoder(FetchReply | Checksum)


def prepare(sock: socket.socket, timeout: float) -> None:
    """Blocking mode with kernel-side timeouts: a block transfer is then a few system calls
    that wait in the kernel without the GIL (Python's own timeouts poll between partial
    reads, and each of those would wait for the GIL behind a busy engine thread)."""
    seconds = int(timeout)
    interval = struct.pack("ll", seconds, int((timeout - seconds) * 1e6))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, interval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, interval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Sends the buffers in order, gathering many per system call."""
    pending = [v for v in views if len(v)]
    while pending:
        sent = sock.sendmsg(pending[:IOV_BATCH])
        pending = _advance(pending, sent)


def recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fills the buffers in order, scattering into many per system call."""
    pending = [v for v in views if len(v)]
    while pending:
        got = sock.recvmsg_into(pending[:IOV_BATCH], 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise ConnectionError("KV peer closed the connection")
        pending = _advance(pending, got)


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    i = 0
    while n and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    rest = views[i:]
    if n:
        rest[0] = rest[0][n:]
    return rest


def proof(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, b"ember-kv:" + nonce, hashlib.sha256).digest()


def authenticate_client(sock: socket.socket, secret: bytes) -> bool:
    """Server side of the handshake; False (and nothing sent back) for a wrong proof."""
    nonce = os.urandom(NONCE_BYTES)
    sock.sendall(nonce)
    answer = recv_exact(sock, 32 + NONCE_BYTES)
    if not hmac.compare_digest(answer[:32], proof(secret, nonce)):
        return False
    sock.sendall(proof(secret, b"server:" + answer[32:]))
    return True


def authenticate_server(sock: socket.socket, secret: bytes) -> None:
    """Client side of the handshake; raises ConnectionError if the server fails it."""
    nonce = recv_exact(sock, NONCE_BYTES)
    mine = os.urandom(NONCE_BYTES)
    sock.sendall(proof(secret, nonce) + mine)
    if not hmac.compare_digest(recv_exact(sock, 32), proof(secret, b"server:" + mine)):
        raise ConnectionError("the KV endpoint did not prove it holds the cluster secret")


def send_frame(sock: socket.socket, message) -> None:
    payload = _encoder.encode(message)
    sock.sendall(_LEN.pack(len(payload)) + payload)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("KV peer closed the connection")
        got += n


def _recv_payload(sock: socket.socket) -> bytes:
    (length,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if length > MAX_FRAME:
        raise ConnectionError(f"KV frame of {length} bytes is too large")
    return recv_exact(sock, length)


def recv_client_message(sock: socket.socket) -> Fetch | Release:
    return _client_decoder.decode(_recv_payload(sock))


def recv_reply(sock: socket.socket) -> FetchReply | Checksum:
    return _reply_decoder.decode(_recv_payload(sock))
