"""One model's ranks over several nodes (ember.distributed.nodes), each node here a
process tree on loopback: the head (rank 0 in this process) and `ember serve
--node-rank K`, which starts its node's ranks. Ranks on different nodes talk over Gloo
and CURVE sockets keyed with the cluster secret, never shared memory; the result is the
single-process one; a node without the secret, or started for another layout, is not
let in; a node's death fails the head cleanly, and the head's ends the node."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from test_tensor_parallel import PROMPTS, _assert_same, _run

from ember import LLM, SamplingParams
from ember.config import EngineConfig
from ember.distributed import nodes, shm_comm
from ember.distributed.executor import RankFailedError

pytestmark = pytest.mark.skipif(not shm_comm.ORDERED_STORES, reason="x86-64 ranks")

SECRET = "nodes-test-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv("EMBER_CLUSTER_SECRET", SECRET)
    monkeypatch.setenv("EMBER_NODE_JOIN_TIMEOUT", "120")


def _node(addr: str, node_rank: int, *flags: str, secret: str | None = SECRET):
    """`ember serve --node-rank node_rank` of a model whose head is at `addr`."""
    env = {k: v for k, v in os.environ.items() if k != "EMBER_CLUSTER_SECRET"}
    if secret is not None:
        env["EMBER_CLUSTER_SECRET"] = secret
    command = [sys.executable, "-m", "ember.cli", "serve", "--nnodes", "2",
               "--node-rank", str(node_rank), "--dist-init-addr", addr, *flags]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip


def _finish(node: subprocess.Popen, timeout: float = 30) -> tuple[int, str]:
    try:
        out, _ = node.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(node.pid, signal.SIGKILL)
        out, _ = node.communicate()
        pytest.fail(f"the node did not exit:\n{out}")
    return node.returncode, out


@pytest.mark.parametrize(
    "arch, layout, flags",
    [
        pytest.param("llama", {"tensor_parallel_size": 2}, ["-tp", "2"], id="tp2"),
        pytest.param(
            "llama",
            {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
            ["-tp", "2", "-pp", "2"],
            id="tp2xpp2",
        ),
        pytest.param(
            "qwen3_moe",
            {"tensor_parallel_size": 2, "data_parallel_attention": True, "expert_parallel": True},
            ["-tp", "2"],
            id="dp-attention",
        ),
    ],
)
def test_ranks_over_two_nodes_give_the_single_process_result(
    tiny_checkpoint, secret, arch: str, layout: dict, flags: list[str]
) -> None:
    """TP=2 with one rank per node (its all-reduces over Gloo), TP=2 x PP=2 with a stage
    per node (each stage's all-reduces in shared memory, the residual stream from node to
    node), and attention data-parallel with the experts by rank (the rows gathered and
    reduce-scattered over Gloo); chunked prefill and a prefix-cache hit, as one process.
    The node exits 0 once the head stops."""
    path = tiny_checkpoint(arch)
    addr = f"127.0.0.1:{_free_port()}"
    node = _node(addr, 1, *flags)
    single, _ = _run(path, max_num_batched_tokens=16)
    parallel, (_, cached) = _run(
        path, max_num_batched_tokens=16, nnodes=2, dist_init_addr=addr, **layout
    )
    _assert_same(single, parallel)
    assert cached == 48
    code, out = _finish(node)
    assert code == 0, out
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("ember-comm")]


def test_a_group_over_two_nodes_does_not_use_shared_memory(tiny_checkpoint, secret) -> None:
    """The tensor-parallel group spans the nodes: Gloo, no /dev/shm segment; the store
    listens on the address given only."""
    addr = f"127.0.0.1:{_free_port()}"
    node = _node(addr, 1, "-tp", "2")
    with LLM(str(tiny_checkpoint("llama")), kv_cache_memory=8 << 20, tensor_parallel_size=2,
             nnodes=2, dist_init_addr=addr) as llm:  # fmt: skip
        runner = llm.engine.core.runner
        assert runner.group.comm is not None and not runner.group.comm.enabled
        listening = subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout
        port = addr.rsplit(":", 1)[1]
        assert f"127.0.0.1:{port} " in listening
        assert f"0.0.0.0:{port} " not in listening and f"*:{port} " not in listening
    assert _finish(node)[0] == 0


def test_a_node_without_the_secret_is_not_let_in(tiny_checkpoint, secret, monkeypatch) -> None:
    """A node with another secret fails its CURVE handshake: it exits naming the secret,
    and the head, which never saw it join, gives up naming the node."""
    monkeypatch.setenv("EMBER_NODE_JOIN_TIMEOUT", "15")
    addr = f"127.0.0.1:{_free_port()}"
    node = _node(addr, 1, "-tp", "2", secret="another-secret")
    with pytest.raises(RankFailedError, match=r"rank 1 \(node 1\) did not join"):
        LLM(str(tiny_checkpoint("llama")), kv_cache_memory=8 << 20, tensor_parallel_size=2,
            nnodes=2, dist_init_addr=addr)  # fmt: skip
    code, out = _finish(node)
    assert code != 0
    assert "EMBER_CLUSTER_SECRET differs" in out


def test_a_node_started_for_another_layout_is_refused(tiny_checkpoint, secret) -> None:
    """Node 1 started with -tp 4 for a head of -tp 2: the head names the mismatch, and
    the node's ranks exit."""
    addr = f"127.0.0.1:{_free_port()}"
    node = _node(addr, 1, "-tp", "4")
    refused = (
        "node 1 was started for 4 ranks over 2 nodes; the head at .* runs its model on 2 ranks"
    )
    with pytest.raises(RankFailedError, match=refused):
        LLM(str(tiny_checkpoint("llama")), kv_cache_memory=8 << 20, tensor_parallel_size=2,
            nnodes=2, dist_init_addr=addr)  # fmt: skip
    code, out = _finish(node, timeout=60)
    assert code != 0
    assert re.search(refused, out)


def test_a_dead_node_fails_the_head(tiny_checkpoint, secret) -> None:
    """Node 1 killed mid-service: the head's next step raises naming its rank, and the
    engine refuses any further step."""
    addr = f"127.0.0.1:{_free_port()}"
    node = _node(addr, 1, "-tp", "2")
    llm = LLM(str(tiny_checkpoint("llama")), kv_cache_memory=8 << 20, tensor_parallel_size=2,
              nnodes=2, dist_init_addr=addr)  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0)
    assert len(llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids) == 4
    os.killpg(node.pid, signal.SIGKILL)
    node.wait()
    with pytest.raises(RankFailedError, match=r"rank 1 \(node 1\) of 2: the connection"):
        llm.generate(PROMPTS[:1], params)
    with pytest.raises(RankFailedError):  # no half-working engine either
        llm.generate(PROMPTS[:1], params)
    llm.close()


def test_a_node_whose_head_dies_exits(tiny_checkpoint, secret) -> None:
    """The head's process killed once it serves (no Stop sent): the node's rank notices
    (the closed connection, or the heartbeats) and the node exits non-zero."""
    addr, port = f"127.0.0.1:{_free_port()}", _free_port()
    node = _node(addr, 1, "-tp", "2")
    head = subprocess.Popen(
        [sys.executable, "-m", "ember.cli", "serve", str(tiny_checkpoint("llama")), "-tp", "2",
         "--nnodes", "2", "--dist-init-addr", addr, "--kv-cache-memory", "8MB",
         "--port", str(port)],
        env=dict(os.environ, EMBER_CLUSTER_SECRET=SECRET), start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert head.poll() is None and node.poll() is None
            time.sleep(0.2)
        else:
            pytest.fail("the head did not serve")
    finally:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
    code, out = _finish(node, timeout=60)
    assert code != 0
    assert "the connection to rank 0 at tcp://127.0.0.1:" in out


def test_layouts_over_nodes_that_cannot_run_are_refused() -> None:
    def config(**options):
        return EngineConfig(tensor_parallel_size=2, **options)

    with pytest.raises(ValueError, match="must split evenly over the nodes"):
        config(nnodes=4, dist_init_addr="h:1")
    with pytest.raises(ValueError, match="needs dist_init_addr"):
        config(nnodes=2)
    with pytest.raises(ValueError, match="dist_init_addr must be HOST:PORT"):
        config(nnodes=2, dist_init_addr="head")
    with pytest.raises(ValueError, match="nnodes must be a positive integer"):
        config(nnodes=0)
    with pytest.raises(ValueError, match="KV connectors"):
        config(nnodes=2, dist_init_addr="h:1", kv_role="prefill", device="cpu")
    assert nodes.parse_addr("[::1]:29500") == ("::1", 29500)


def test_a_node_needs_the_secret_and_a_place(monkeypatch) -> None:
    monkeypatch.delenv("EMBER_CLUSTER_SECRET", raising=False)
    layout = nodes.Nodes(2, 2, "127.0.0.1:1")
    with pytest.raises(ValueError, match=r"\$EMBER_CLUSTER_SECRET"):
        nodes.run_node(layout, 1)
    monkeypatch.setenv("EMBER_CLUSTER_SECRET", SECRET)
    with pytest.raises(ValueError, match="node_rank must be 1..1"):
        nodes.run_node(layout, 2)
    with pytest.raises(ValueError, match="give nnodes too"):
        nodes.run_node(nodes.Nodes(2), 1)


def test_a_busy_address_fails_the_head_with_no_rank_left(tiny_checkpoint, secret) -> None:
    """The head cannot listen at dist_init_addr: a ValueError naming it, before any rank."""
    from test_tensor_parallel import _rank_processes

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        addr = f"127.0.0.1:{busy.getsockname()[1]}"
        with pytest.raises(ValueError, match=f"dist_init_addr {addr}: cannot listen there"):
            LLM(str(tiny_checkpoint("llama")), kv_cache_memory=8 << 20,
                tensor_parallel_size=4, nnodes=2, dist_init_addr=addr)  # fmt: skip
    assert not _rank_processes()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_links_prove_the_secret_and_see_their_peer_go(host: str) -> None:
    """Rank 0's socket and a rank's (IPv4 and IPv6): the right secret connects and
    carries messages; another secret is refused on the connecting side (the bound side
    only counts it); a peer that closes is seen down."""
    import zmq

    context = zmq.Context()
    try:
        head = nodes.Link.bind(context, b"right", host, 1)
    except (OSError, zmq.ZMQError) as exc:
        pytest.skip(f"no {host} here: {exc}")
    stranger = nodes.Link.connect(context, b"wrong", head.address)
    deadline = time.monotonic() + 10
    while stranger.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "refused this rank's key: $EMBER_CLUSTER_SECRET differs" in stranger.down
    assert head.poll() is None and not head.up and head.refusals >= 1
    stranger.close()
    rank = nodes.Link.connect(context, b"right", head.address)
    rank.socket.send(b"hello")
    assert head.socket.poll(10_000) and head.socket.recv() == b"hello"
    assert head.poll() is None and head.up
    rank.close()
    while head.poll() is None and time.monotonic() < deadline + 10:
        time.sleep(0.05)
    assert "the connection to rank 1 closed" in head.down
    head.close()
    context.term()
