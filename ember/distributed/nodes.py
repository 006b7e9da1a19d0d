"""One model's ranks on several hosts (nodes): where each rank runs, how remote ranks
find rank 0 and prove they belong, and the process that runs a node's ranks.

`ember serve MODEL -tp 4 --nnodes 2 --dist-init-addr HEAD:PORT` on the head (node 0: the
API, the engine core as rank 0, ranks 1..per_node-1) and the same command with
`--node-rank 1` on the other host, which serves no API: `run_node` starts that node's
ranks (per_node of them, each with its share of the node's cores) and exits with them.

Rendezvous: rank 0 listens on HEAD:PORT with a torch.distributed TCPStore (bound to that
address only), binds one ZeroMQ PAIR socket per remote rank on HEAD's address and puts
each socket's address in the store; a remote rank reads its address there, connects and
says Hello, and gets the engine config from rank 0 (`Setup`), so a node needs no flags
but the layout and the address. The process group then forms over the same store (Gloo;
each node's tensor-parallel groups keep the shared-memory path, a group spanning nodes
uses Gloo).

Trust: the control sockets use CURVE (encrypted, and both keys derived from the
cluster's secret, $EMBER_CLUSTER_SECRET, which every node must have): a process without
the secret cannot connect to rank 0 nor pose as it. torch.distributed's own traffic (the
store's keys, Gloo's tensors) has no authentication at all: the nodes' network must be
a private one, as for vLLM, SGLang and torch.distributed.

Liveness: ZeroMQ heartbeats on those sockets (run by ZeroMQ's I/O thread, whatever the
Python thread is doing) close a connection whose peer is gone or unreachable; rank 0
then fails the model with a clear error, a remote rank exits, and its node with it.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from ember import envs

if TYPE_CHECKING:
    from ember.config import EngineConfig

logger = logging.getLogger("ember.distributed")

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000  # a peer silent this long is gone
# in the store: a remote rank's control socket; the head's layout; why a node's rank
# will not join it
STORE_KEY = "ember/socket/{rank}"
LAYOUT_KEY = "ember/layout"
REFUSED_KEY = "ember/refused"
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass(frozen=True)
class Nodes:
    """Where the `world_size` ranks of a model run: `nnodes` hosts, ranks
    [n * per_node, (n + 1) * per_node) on node n; rank 0 (on node 0) at `addr`."""

    world_size: int
    nnodes: int = 1
    addr: str | None = None  # HOST:PORT of rank 0's store (nnodes > 1)

    @classmethod
    def of(cls, config: EngineConfig) -> Nodes:
        return cls(config.world_size, config.nnodes, config.dist_init_addr)

    @property
    def per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    def same_node(self, ranks: list[int]) -> bool:
        return len({self.node_of(rank) for rank in ranks}) == 1

    @property
    def host_port(self) -> tuple[str, int]:
        return parse_addr(self.addr)

    @property
    def layout(self) -> str:
        return f"{self.world_size} ranks over {self.nnodes} nodes"


def parse_addr(addr: str) -> tuple[str, int]:
    """(host, port) of "HOST:PORT" (an IPv6 host in brackets); ValueError naming
    dist_init_addr otherwise."""
    host, sep, port = addr.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dist_init_addr must be HOST:PORT; got {addr!r}")
    return host, int(port)


def check_nodes(world_size: int, nnodes: int, addr: str | None, moves_kv: bool) -> None:
    """Refuses a layout over nodes that cannot run (ValueError naming the parameter)."""
    if not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes must be a positive integer, got {nnodes!r}")
    if nnodes == 1:
        return
    if world_size % nnodes:
        raise ValueError(
            f"nnodes={nnodes}: the model's {world_size} ranks (tensor_parallel_size x "
            "pipeline_parallel_size) must split evenly over the nodes"
        )
    if addr is None:
        raise ValueError(f"nnodes={nnodes} needs dist_init_addr (HOST:PORT of the head node)")
    parse_addr(addr)
    if moves_kv:
        raise ValueError(
            f"nnodes={nnodes} does not work with KV connectors (kv_role, KV tiers) yet: they "
            "reach every rank's KV through one shared-memory file on the head's host"
        )


def node_secret() -> bytes:
    """The cluster secret the nodes' control sockets are keyed with; ValueError if unset."""
    secret = envs.cluster_secret()
    if not secret:
        raise ValueError(
            "a model over several nodes needs $EMBER_CLUSTER_SECRET, the same on every "
            "node: the ranks' control sockets are encrypted and authenticated with it"
        )
    return secret


def _resolve(host: str) -> tuple[socket.AddressFamily, str]:
    """The address family and IP address the head's `host` names."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0]
    return family, sockaddr[0]


def _curve_keys(secret: bytes, purpose: bytes) -> tuple[bytes, bytes]:
    """A CURVE key pair (public, secret; Z85) derived from the cluster secret."""
    raw = hmac.new(secret, b"ember:rank-" + purpose, hashlib.sha256).digest()
    secret_key = z85.encode(raw)
    return zmq.curve_public(secret_key), secret_key


def _socket_options(sock: zmq.Socket, ipv6: bool) -> None:
    sock.setsockopt(zmq.IPV6, int(ipv6))
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


class Link:
    """A control socket to or from a remote rank, and what its connection went through:
    `up` once a peer proved the secret, `down` (a reason) once that peer's connection
    closed or the secret was refused."""

    def __init__(self, sock: zmq.Socket, peer: str, bound: bool) -> None:
        self.socket = sock
        self.peer = peer
        self.bound = bound  # rank 0's side: strangers may try it too
        self.monitor = sock.get_monitor_socket()
        self.up = False
        self.down: str | None = None
        self.refusals = 0
        self._accepted: int | None = None  # the connection last accepted (bound side)
        self._fd: int | None = None  # the one that proved the secret

    @classmethod
    def bind(cls, context: zmq.Context, secret: bytes, host: str, rank: int) -> Link:
        """Rank 0's socket for remote rank `rank`, on an ephemeral port of `host`."""
        sock = context.socket(zmq.PAIR)
        public, secret_key = _curve_keys(secret, b"head")
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = public, secret_key
        family, ip = _resolve(host)
        _socket_options(sock, ipv6=family == socket.AF_INET6)
        link = cls(sock, f"rank {rank}", bound=True)
        sock.bind(f"tcp://[{ip}]:*" if family == socket.AF_INET6 else f"tcp://{ip}:*")
        return link

    @classmethod
    def connect(cls, context: zmq.Context, secret: bytes, address: str) -> Link:
        """A remote rank's socket to rank 0 at `address`."""
        sock = context.socket(zmq.PAIR)
        sock.curve_serverkey = _curve_keys(secret, b"head")[0]
        sock.curve_publickey, sock.curve_secretkey = _curve_keys(secret, b"rank")
        _socket_options(sock, ipv6="[" in address)
        link = cls(sock, f"rank 0 at {address}", bound=False)
        sock.connect(address)
        return link

    @property
    def address(self) -> str:
        return self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()

    def poll(self) -> str | None:
        """Reads the connection's events so far; `down` (or None while it holds)."""
        while self.down is None and self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                self._accepted = value
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self.up:
                self.up, self._fd = True, self._accepted
            elif kind & HANDSHAKE_FAILED:
                self._refused()
            elif kind == zmq.EVENT_DISCONNECTED and self.up and self._fd in (None, value):
                self.down = f"the connection to {self.peer} closed (its process or host is gone)"
        return self.down

    def _refused(self) -> None:
        self.refusals += 1
        if self.bound:  # someone without the secret (or with another): not our peer
            if self.refusals == 1:
                logger.warning(
                    "%s's socket: a connection failed the CURVE handshake (is "
                    "$EMBER_CLUSTER_SECRET the same on every node?)", self.peer,
                )  # fmt: skip
        elif not self.up:
            self.down = f"{self.peer} refused this rank's key: $EMBER_CLUSTER_SECRET differs"

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)


def _join_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=envs.node_join_timeout())


def head_store(nodes: Nodes):
    """Rank 0's TCPStore, listening on the head's address only."""
    import torch.distributed as dist

    host, port = nodes.host_port
    try:
        listener = socket.create_server((host, port), family=_resolve(host)[0], backlog=128)
    except OSError as exc:
        raise ValueError(f"dist_init_addr {nodes.addr}: cannot listen there: {exc}") from exc
    try:
        return dist.TCPStore(
            host, port, None, True, _join_timeout(), wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )  # fmt: skip
    except BaseException:
        listener.close()
        raise


def node_store(nodes: Nodes, rank: int):
    """Rank `rank`'s client of rank 0's store (it waits for the head to listen); a
    ValueError, which the head hears of too, if the head's layout is another."""
    import torch.distributed as dist

    host, port = nodes.host_port
    store = dist.TCPStore(host, port, None, False, _join_timeout())
    head = store.get(LAYOUT_KEY).decode()
    if head != nodes.layout:
        reason = (
            f"node {nodes.node_of(rank)} was started for {nodes.layout}; the head at "
            f"{nodes.addr} runs its model on {head}: start every node with the head's "
            "--tensor-parallel-size, --pipeline-parallel-size and --nnodes"
        )
        store.set(REFUSED_KEY, reason)
        raise ValueError(reason)
    return store


def run_node(nodes: Nodes, node_rank: int, threads: int | None = None) -> int:
    """Runs node `node_rank`'s ranks of a model whose rank 0 is at `nodes.addr` until they
    exit (all: 0; one failed: the others are stopped, its exit code). No API here."""
    from ember.distributed.executor import RANK_MODULE, rank_threads

    node_secret()  # refused here, before any rank starts, if unset
    if nodes.nnodes == 1:
        raise ValueError("node_rank applies to a model over several nodes: give nnodes too")
    if not 0 < node_rank < nodes.nnodes:
        raise ValueError(
            f"node_rank must be 1..{nodes.nnodes - 1} on a node that is not the head "
            f"(the head, node 0, serves the API); got {node_rank!r}"
        )
    ranks = nodes.ranks_of(node_rank)
    logger.info(
        "node %d of %d: ranks %d-%d of %d, joining rank 0 at %s",
        node_rank, nodes.nnodes, ranks[0], ranks[-1], nodes.world_size, nodes.addr,
    )  # fmt: skip
    processes = []
    for local, rank in enumerate(ranks):
        flags = {
            "--rank": rank, "--size": nodes.world_size, "--nnodes": nodes.nnodes,
            "--dist-init-addr": nodes.addr,
            "--threads": threads or rank_threads(nodes.per_node, local),
        }  # fmt: skip
        command = [sys.executable, *RANK_MODULE]
        command += [str(part) for flag in flags.items() for part in flag]
        processes.append(subprocess.Popen(command, env=envs.engine_core_env()))
    return _watch(processes)


def _watch(processes: list[subprocess.Popen]) -> int:
    """Waits for the ranks; the first to fail stops the others. SIGTERM / SIGINT stop all."""
    stopping = []

    def stop(signum, frame):
        stopping.append(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stopping:
            codes = [process.poll() for process in processes]
            failed = [code for code in codes if code not in (None, 0)]
            if failed or all(code == 0 for code in codes):
                return failed[0] if failed else 0
            time.sleep(0.2)
        return 128 + stopping[0]
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + 5.0
        for process in processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
