"""Running one model over several ranks: rank 0 in the engine-core process, ranks 1..N-1 in
worker processes it starts, watches and stops (`MultiprocExecutor`).

The core schedules once; its ModelRunner (rank 0) runs the step as it would alone, on a
`LeaderModel` that first sends every model call (a forward over the step's inputs, logits
of some hidden rows) to the other ranks, which make the same call on their shard
(`ember.distributed.rank_worker`), so that every rank enters the same collectives in the
same order. Only rank 0 samples, keeps requests and runs the KV connectors; when they
are on, every rank's KV tensors live in one shared-memory file rank 0 maps too
(ember.kv.layout), so they move every rank's blocks.

Pipeline stages (ember.distributed.parallel.PipelineStage): rank 0's forward is the first
stage's; it sends the residual stream on to the next stage (torch.distributed isend) and
returns a `PendingHidden` for the last stage's, which arrives while rank 0 starts the
next step. Logits calls go to the first stage only (it holds the head).

Data-parallel attention: each rank gets a Forward of its own sequences' inputs (with
every rank's token count), and the hidden states of all come back to rank 0 in one
gather of rows (`LeaderModel.forward_ranks`); logits are rank 0's alone (the head is
whole on every rank), and `ExpertCounts` asks the ranks for their MoE token counts.

Messages are msgspec structs over a ZeroMQ PAIR socket per rank (ipc, in a private
directory; a rank on another node: tcp, CURVE, see ember.distributed.nodes): `Hello`
(imports done) -> `Setup` (the engine config) -> every rank joins the process group ->
`Ready` (model loaded: its KV block bytes, weight bytes and what its KV tensors hold) or
`Failed` -> `AllocateKV` (private, or views of rank 0's shared file), then
`Forward` / `Logits` per call, `Stop`.

Failure: the workers die with the core (PR_SET_PDEATHSIG); a worker that exits or fails
(a node whose connection closes) makes rank 0's next collective raise `RankFailedError`
(the shared-memory wait checks the processes every few ms; Gloo's sockets close), after
which the executor stops the rest and refuses further calls. The engine then fails as a
whole, with that error.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import msgspec
import torch
import torch.distributed as dist
import zmq

from ember import envs
from ember.config import EngineConfig
from ember.cpus import usable_cpus
from ember.distributed import nodes
from ember.distributed.nodes import Link, Nodes
from ember.distributed.parallel import PipelineStage, TPGroup, building, wait
from ember.distributed.shm_comm import ShmCommunicator
from ember.model_config import ModelConfig

logger = logging.getLogger("ember.distributed")

STARTUP_TIMEOUT_S = 600.0  # a rank's imports and model load
# joining the process group, and any collective's wait for the other ranks (Gloo's)
JOIN_TIMEOUT = datetime.timedelta(seconds=120)
PEER_LOSS_S = 1.0  # how long a failed collective waits to learn which rank went
TERM_S = 5.0  # how long close() waits for the zmq context to end
RANK_MODULE = ["-m", "ember.distributed.rank_worker"]  # what a rank runs (tests wrap it)


class RankFailedError(RuntimeError):
    """A rank of a tensor-parallel model stopped; the model cannot run without it."""


class Tensor(msgspec.Struct, array_like=True):
    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Tensor:
        tensor = tensor.detach().contiguous().cpu()
        raw = tensor.view(-1).view(torch.uint8) if tensor.numel() else tensor.new_empty(0)
        return cls(
            str(tensor.dtype).removeprefix("torch."), list(tensor.shape), raw.numpy().tobytes()
        )

    def value(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.data), dtype=dtype).view(self.shape)


class Hello(msgspec.Struct, tag=True):
    rank: int


class Setup(msgspec.Struct, tag=True):
    """What a rank builds: the engine config (JSON) and the context length."""

    config: str
    max_model_len: int


class Ready(msgspec.Struct, tag=True):
    rank: int
    kv_block_bytes: int
    weight_bytes: int
    kv_pieces: list[tuple[int, int, int]]  # (layer, head start, head stop) per KV tensor


class Failed(msgspec.Struct, tag=True):
    rank: int
    message: str


class AllocateKV(msgspec.Struct, tag=True):
    num_blocks: int
    # the file rank 0 made for every rank's KV tensors, and where each rank's start in
    # it (index rank - 1); None: each rank allocates its own, private
    shm_path: str | None = None
    rank_offsets: list[list[int]] | None = None


class Prefill(msgspec.Struct, array_like=True):
    query_start: int
    query_len: int
    context_len: int
    block_ids: Tensor


class Forward(msgspec.Struct, tag=True):
    input_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    num_decodes: int
    num_decode_seqs: int | None
    decode_block_table: Tensor | None  # (the decode mask is made again from these two)
    decode_context_lens: Tensor | None
    prefills: list[Prefill]
    # data-parallel attention: every rank's tokens this step (this Forward is its own)
    rank_tokens: list[int] | None = None


class Logits(msgspec.Struct, tag=True):
    hidden: Tensor


class ExpertCounts(msgspec.Struct, tag=True):
    """Asks a rank for its MoE layers' token counts (data-parallel attention: each rank
    counts its own tokens); it answers with `Counts`."""


class Counts(msgspec.Struct, tag=True):
    rank: int
    counts: list[list[int]]  # per MoE layer, tokens per expert


class Stop(msgspec.Struct, tag=True):
    pass


ToRank = Setup | AllocateKV | Forward | Logits | ExpertCounts | Stop
FromRank = Hello | Ready | Failed | Counts


def encode_forward(input_ids, positions, meta, rank_tokens: list[int] | None = None) -> Forward:
    def opt(tensor):
        return None if tensor is None else Tensor.of(tensor)

    prefills = [
        Prefill(p.query_start, p.query_len, p.context_len, Tensor.of(p.block_ids))
        for p in meta.prefills
    ]
    return Forward(
        Tensor.of(input_ids), Tensor.of(positions), Tensor.of(meta.slot_mapping),
        meta.num_decodes, meta.num_decode_seqs, opt(meta.decode_block_table),
        opt(meta.decode_context_lens), prefills, rank_tokens,
    )  # fmt: skip


def decode_forward(message: Forward, device: torch.device, block_size: int):
    """(input_ids, positions, AttentionMetadata) of a Forward, on `device`."""
    from ember.engine.attention import AttentionMetadata, PrefillSeq
    from ember.engine.step_inputs import decode_mask

    def opt(tensor):
        return None if tensor is None else tensor.value().to(device)

    table, context = opt(message.decode_block_table), opt(message.decode_context_lens)
    meta = AttentionMetadata(
        slot_mapping=message.slot_mapping.value().to(device),
        num_decodes=message.num_decodes,
        decode_block_table=table,
        decode_mask=None if table is None else decode_mask(context, table.shape[1], block_size),
        decode_context_lens=context,
        prefills=[
            PrefillSeq(p.query_start, p.query_len, p.context_len, p.block_ids.value().to(device))
            for p in message.prefills
        ],
        num_decode_seqs=message.num_decode_seqs,
    )
    return message.input_ids.value().to(device), message.positions.value().to(device), meta


def join_group(rank: int, config: EngineConfig, store) -> tuple[TPGroup, PipelineStage]:
    """Joins the process group of the config's ranks (stages of tensor_parallel_size ranks
    each) through `store`; this rank's tensor-parallel group (its stage's ranks, over
    shared memory where they share a host) and stage."""
    size, tp_size = config.world_size, config.tensor_parallel_size
    layout = Nodes.of(config)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("ember-pg", store), rank=rank, world_size=size,
        timeout=JOIN_TIMEOUT,
    )  # fmt: skip
    stage, tp_rank = divmod(rank, tp_size)
    comm = None
    stage_ranks = [list(range(s * tp_size, (s + 1) * tp_size)) for s in range(size // tp_size)]
    if tp_size == size:
        comm = ShmCommunicator(shared_memory=layout.same_node(stage_ranks[0]))
    elif tp_size > 1:  # every rank makes every stage's group, in the same order
        groups = [dist.new_group(ranks) for ranks in stage_ranks]
        comm = ShmCommunicator(groups[stage], shared_memory=layout.same_node(stage_ranks[stage]))
    dispatch = "all-gather" if config.moe_dispatch == "auto" else config.moe_dispatch
    group = TPGroup(tp_rank, tp_size, comm, config.expert_parallel,
                    config.data_parallel_attention, dispatch)  # fmt: skip
    return group, PipelineStage(stage, size // tp_size, tp_rank, tp_size)


def check_parallel(
    config: EngineConfig, model_config: ModelConfig, model_cls: type, device: torch.device
) -> None:
    """What a model over several ranks cannot do (yet), refused before any rank starts."""
    size, stages = config.tensor_parallel_size, config.pipeline_parallel_size
    name = f"tensor_parallel_size={size}" if stages == 1 else f"pipeline_parallel_size={stages}"
    if device.type != "cpu":
        raise ValueError(f"{name}: only CPU ranks (Gloo) are supported yet")
    if not hasattr(model_cls, "shard_of"):
        raise ValueError(f"{name}: {model_cls.__name__} cannot be split over ranks yet")
    if config.data_parallel_attention:  # only the experts split
        if model_config.moe is None:
            raise ValueError(
                f"data_parallel_attention: {model_config.architecture} has no mixture-of-"
                "experts layers to share over the ranks; use tensor_parallel_size alone"
            )
    else:
        _check_head_split(config, model_config, model_cls)
    if config.world_size > len(os.sched_getaffinity(0)):
        logger.warning("%d ranks: more ranks than cores", config.world_size)


def _check_head_split(config: EngineConfig, model_config: ModelConfig, model_cls: type) -> None:
    """Refuses a split of the heads or layers the model cannot take."""
    size, stages = config.tensor_parallel_size, config.pipeline_parallel_size
    if size > model_config.num_attention_heads:
        raise ValueError(
            f"tensor_parallel_size={size}: the model has only "
            f"{model_config.num_attention_heads} attention heads"
        )
    if stages > model_config.num_hidden_layers:
        raise ValueError(
            f"pipeline_parallel_size={stages}: the model has only "
            f"{model_config.num_hidden_layers} layers"
        )
    for rank in range(size):  # every rank's heads split as the model needs
        with building(TPGroup(rank, size)):
            model_cls.kv_cache_spec(model_config)


def rank_cores(size: int, rank: int) -> list[int]:
    """The cores rank `rank` of `size` runs its threads on: its share of this process's."""
    cores = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cores) // size)
    first = (rank * per_rank) % len(cores)
    return cores[first : first + per_rank]


def rank_threads(size: int, rank: int) -> int:
    """The torch threads of rank `rank` of `size` on a host: one per core of its share,
    and no more than its share of the CPUs the cgroup's limit allows (ember.cpus)."""
    return min(len(rank_cores(size, rank)), max(1, usable_cpus() // size))


class MultiprocExecutor:
    """Ranks 1..size-1 of a model whose rank 0 is this process."""

    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.size = config.world_size
        self.nodes = Nodes.of(config)
        self._dir = tempfile.mkdtemp(prefix="ember-ranks-")
        self._context = zmq.Context()
        self._sockets: list[zmq.Socket] = []  # rank r's at r - 1
        self._links: dict[int, Link] = {}  # the ranks on other nodes'
        self._processes: list[subprocess.Popen] = []  # this node's ranks
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromRank)
        self.failure: str | None = None
        self.closed = False
        self.rank_block_bytes: list[int] = []
        self.rank_weight_bytes: list[int] = []
        self.rank_kv_pieces: list[list[tuple[int, int, int]]] = []
        atexit.register(self.close)
        self._store = None
        try:
            self._start()
        except BaseException:
            self.close()  # no rank left behind
            raise

    def _start(self) -> None:
        store_flag = ["--store", f"{self._dir}/store"]
        if self.nodes.nnodes > 1:
            secret = nodes.node_secret()
            self._store = nodes.head_store(self.nodes)
            self._store.set(nodes.LAYOUT_KEY, self.nodes.layout)
            store_flag = ["--nnodes", self.nodes.nnodes, "--dist-init-addr", self.nodes.addr]
            for rank in range(self.nodes.per_node, self.size):
                self._bind_remote(rank, secret)
        for rank in range(1, self.nodes.per_node):
            self._start_local(rank, store_flag)

    def _start_local(self, rank: int, store_flag: list) -> None:
        socket = self._context.socket(zmq.PAIR)
        address = f"ipc://{self._dir}/rank{rank}"
        socket.bind(address)
        self._sockets.insert(rank - 1, socket)  # (before the remote ranks')
        threads = rank_threads(self.nodes.per_node, rank)
        flags = ["--rank", rank, "--size", self.size, "--socket", address, "--threads", threads]
        command = [sys.executable, *RANK_MODULE, *map(str, flags + store_flag)]
        self._processes.append(subprocess.Popen(command, env=envs.engine_core_env()))

    def _bind_remote(self, rank: int, secret: bytes) -> None:
        """A socket for a rank on another node, its address in the store for it to find."""
        link = Link.bind(self._context, secret, self.nodes.host_port[0], rank)
        self._links[rank] = link
        self._sockets.append(link.socket)
        self._store.set(nodes.STORE_KEY.format(rank=rank), link.address)

    def _where(self, rank: int) -> str:
        if rank in self._links:
            return f"rank {rank} (node {self.nodes.node_of(rank)})"
        return f"rank {rank}"

    # -- start-up ----------------------------------------------------------------------

    def join(self) -> tuple[TPGroup, PipelineStage]:
        """Rank 0 joins the process group once every rank has imported torch (and sent
        the set-up); returns the tensor-parallel group and pipeline stage the model is
        built for."""
        setup = Setup(msgspec.json.encode(self.config).decode(), self.max_model_len)
        for rank in range(1, self.size):
            self._expect(rank, Hello)
        self.send(setup)
        torch.set_num_threads(rank_threads(self.nodes.per_node, 0))
        store = self._store or dist.FileStore(f"{self._dir}/store", self.size)
        group, stage = join_group(0, self.config, store)
        if group.comm is not None:
            group.comm.check = self.check
        self.group = group
        return group, stage

    def wait_ready(self) -> None:
        """Waits until every rank has loaded its shard (RankFailedError if one failed)."""
        for rank in range(1, self.size):
            ready = self._expect(rank, Ready)
            self.rank_block_bytes.append(ready.kv_block_bytes)
            self.rank_weight_bytes.append(ready.weight_bytes)
            self.rank_kv_pieces.append(ready.kv_pieces)

    def expert_counts(self) -> list[list[list[int]]]:
        """Every other rank's MoE token counts (per layer, per expert), in rank order."""
        self.send(ExpertCounts())
        return [self._expect(rank, Counts).counts for rank in range(1, self.size)]

    def _expect(self, rank: int, kind: type) -> FromRank:
        socket = self._sockets[rank - 1]
        remote = rank in self._links and kind is Hello  # the node may not have started
        timeout = envs.node_join_timeout() if remote else STARTUP_TIMEOUT_S
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if socket.poll(100):
                message = self._decoder.decode(socket.recv())
                if isinstance(message, Failed):
                    self._fail(f"{self._where(rank)} failed: {message.message}")
                if isinstance(message, kind):
                    return message
            self.check()
            if remote and self._store.check([nodes.REFUSED_KEY]):  # a node of another layout
                self._fail(self._store.get(nodes.REFUSED_KEY).decode())
        if remote:
            self._fail(
                f"{self._where(rank)} did not join at {self.nodes.addr} within {timeout:.0f} "
                f"s: is node {self.nodes.node_of(rank)} started (ember serve ... --nnodes "
                f"{self.nodes.nnodes} --node-rank {self.nodes.node_of(rank)})?"
            )
        self._fail(f"{self._where(rank)} did not start within {timeout:.0f} s")

    # -- steps -------------------------------------------------------------------------

    def send(self, message: ToRank) -> None:
        """Sends a call to every other rank (which then makes it with rank 0)."""
        self.send_each([message] * (self.size - 1))

    def send_each(self, messages: list[ToRank]) -> None:
        """Sends rank r its call, messages[r - 1] (data-parallel attention: its inputs)."""
        if self.failure is not None:
            raise RankFailedError(self.failure)
        frames = {id(m): self._encoder.encode(m) for m in messages}
        for socket, message in zip(self._sockets, messages, strict=True):
            frame = frames[id(message)]
            while True:  # a PAIR socket whose peer is gone blocks: look at the ranks
                try:
                    socket.send(frame, zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    self.check()
                    socket.poll(10, zmq.POLLOUT)

    def check(self) -> None:
        """RankFailedError if a rank has exited (or failed) since the last look."""
        if self.failure is not None:
            raise RankFailedError(self.failure)
        for rank, process in enumerate(self._processes, start=1):
            code = process.poll()
            if code is not None:
                self._fail(f"rank {rank} of {self.size} exited (code {code}){self._reason(rank)}")
        for rank, link in self._links.items():
            if link.poll() is not None:
                self._fail(f"{self._where(rank)} of {self.size}: {link.down}{self._reason(rank)}")

    def _reason(self, rank: int) -> str:
        """A failed rank's own last word, if it sent one."""
        socket = self._sockets[rank - 1]
        while socket.poll(0):
            message = self._decoder.decode(socket.recv())
            if isinstance(message, Failed):
                return f": {message.message}"
        return ""

    def _fail(self, reason: str):
        self.failure = reason
        logger.error("tensor-parallel model stopped: %s", reason)
        self.close()
        raise RankFailedError(reason)

    def failed_call(self, what: str, exc: Exception) -> RankFailedError:
        """The error for a call that raised `exc` (the ranks are stopped): the rank found
        gone, if one is within a second (a peer's loss breaks the collectives before its
        exit or closed socket is seen), else `what` failed."""
        deadline = time.monotonic() + PEER_LOSS_S
        while True:
            try:
                self.check()
            except RankFailedError as failed:
                return failed
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.fail(f"{what} failed: {type(exc).__name__}: {exc}")
        return RankFailedError(self.failure)

    def fail(self, reason: str) -> None:
        """Stops every rank (rank 0 left a call half done; the ranks are out of step)."""
        if self.failure is None:
            self.failure = reason
            self.close()

    def close(self) -> None:
        """Stops the ranks (Stop, then SIGKILL after a grace period) and leaves nothing."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        frame = self._encoder.encode(Stop())
        for socket in self._sockets:
            try:
                socket.send(frame, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + 5.0
        for process in self._processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for rank, socket in enumerate(self._sockets, start=1):
            if rank in self._links:
                socket.setsockopt(zmq.LINGER, 1000)  # Stop on its way to another node
                self._links[rank].close()
            else:
                socket.close(linger=0)
        _term_within(self._context, TERM_S)
        self._store = None
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._dir, ignore_errors=True)


def _term_within(context: zmq.Context, seconds: float) -> None:
    """Ends a zmq context whose sockets are all closed, waiting at most `seconds`: libzmq's
    term blocked for ever, once in a full test run, after a rank was killed mid-step
    (its sockets closed with linger 0); the context is then left to its own thread."""
    ender = threading.Thread(target=context.term, name="zmq-term", daemon=True)
    ender.start()
    ender.join(seconds)
    if ender.is_alive():
        logger.warning("the ranks' zmq context did not end within %.0f s; left behind", seconds)


class PendingHidden:
    """The last pipeline stage's hidden states of a step, on their way to rank 0."""

    def __init__(self, sent, out: torch.Tensor, received, executor: MultiprocExecutor) -> None:
        self.sent, self.out, self.received = sent, out, received
        self.executor = executor

    def result(self) -> torch.Tensor:
        try:
            wait(self.received, self.executor.check)
            wait(self.sent, self.executor.check)
        except RankFailedError:
            raise
        except Exception as exc:  # Gloo's error for a peer that is gone
            raise self.executor.failed_call("pipeline transfer", exc) from exc
        return self.out


class LeaderModel:
    """Rank 0's model: every forward and logits call goes to the other ranks first, then
    runs here (the collectives inside pair them up). Other attributes are the model's
    (`inner`). With pipeline stages a forward returns a PendingHidden."""

    def __init__(
        self, inner: torch.nn.Module, executor: MultiprocExecutor, stage: PipelineStage
    ) -> None:
        self.inner = inner
        self.executor = executor
        self.stage = stage

    def __call__(self, input_ids, positions, kv_caches, meta):
        hidden = self._run(encode_forward(input_ids, positions, meta), self.inner, input_ids,
                           positions, kv_caches, meta)  # fmt: skip
        if self.stage.size == 1:
            return hidden
        out = torch.empty_like(hidden)
        try:  # Gloo can refuse to post a transfer at once, to a peer already gone
            sent = self.stage.send(hidden, 1)
            received = self.stage.irecv(out, self.stage.size - 1)
        except RuntimeError as exc:
            raise self.executor.failed_call("pipeline transfer", exc) from exc
        return PendingHidden(sent, out, received, self.executor)

    def forward_ranks(self, inputs: list[tuple], kv_caches) -> torch.Tensor:
        """Data-parallel attention: rank r runs inputs[r] (input ids, positions, metadata),
        its own sequences; every rank's hidden states, in rank order."""
        group = self.executor.group
        group.rank_tokens = [len(ids) for ids, _, _ in inputs]
        messages = [encode_forward(*x, rank_tokens=group.rank_tokens) for x in inputs[1:]]
        ids, positions, meta = inputs[0]

        def run():
            return group.gather_rows(self.inner(ids, positions, kv_caches, meta))

        return self._run(messages, run)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.executor.group.data_parallel_attention:  # the head is whole on rank 0
            return self.inner.compute_logits(hidden)
        return self._run(Logits(Tensor.of(hidden)), self.inner.compute_logits, hidden)

    def _run(self, message: ToRank | list[ToRank], call, *args):
        if isinstance(message, list):
            self.executor.send_each(message)
        else:
            self.executor.send(message)
        try:
            return call(*args)
        except RankFailedError:
            raise
        except RuntimeError as exc:  # torch.distributed's, when a peer is gone
            raise self.executor.failed_call("rank 0's model call", exc) from exc
        except BaseException as exc:
            self.executor.fail(f"rank 0 failed in a model call: {type(exc).__name__}: {exc}")
            raise

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
