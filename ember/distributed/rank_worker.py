"""A rank > 0 of a tensor-parallel model: `python -m ember.distributed.rank_worker`.

Started by rank 0's MultiprocExecutor (see there for the protocol), or on another node by
`ember serve --node-rank K` (ember.distributed.nodes). Builds and loads its
shard of the model as rank 0 does (ModelRunner, in `building(group)`), then makes every
model call rank 0 sends, on its shard, until `Stop`: a later pipeline stage receives the
previous stage's residual stream first, and every stage but the last sends its own on
(the last stage's rank 0 sends it back to rank 0). Dies with its parent (SIGKILL), and
tells rank 0 why before it exits on an error; on another node it exits once rank 0's
connection closes.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys

import msgspec
import zmq

from ember import envs, startup
from ember.distributed import executor as ex
from ember.distributed.nodes import STORE_KEY, Link, Nodes, node_secret, node_store
from ember.engine.core_proc import die_with_parent

logger = logging.getLogger("ember.distributed")


def _die_with_parent() -> None:
    """SIGKILL when rank 0 dies: a rank holds nothing worth a clean exit."""
    die_with_parent(signal.SIGKILL)


def serve(rank: int, args: argparse.Namespace, channel: Channel) -> None:
    import torch

    from ember.config import EngineConfig
    from ember.distributed.parallel import wait
    from ember.engine.model_runner import ModelRunner
    from ember.loader.checkpoint import open_checkpoint
    from ember.loader.default_models import resolve_model
    from ember.model_config import ModelConfig

    per_node = args.size // args.nnodes
    os.sched_setaffinity(0, ex.rank_cores(per_node, rank % per_node))
    torch.set_num_threads(args.threads)
    channel.send(ex.Hello(rank))
    setup = channel.recv()
    if not isinstance(setup, ex.Setup):
        raise RuntimeError(f"rank 0 sent {type(setup).__name__} before Setup")
    config = msgspec.json.decode(setup.config.encode(), type=EngineConfig)
    group, stage = ex.join_group(rank, config, channel.store)
    torch.manual_seed(config.seed)
    checkpoint = open_checkpoint(resolve_model(config.model))
    model_config = ModelConfig.from_hf(checkpoint.hf_config)
    runner = ModelRunner(
        config, model_config, checkpoint, setup.max_model_len, group=group, stage=stage
    )
    startup.release_collector()
    pieces = [tuple(piece) for piece in runner.kv_pieces]
    channel.send(ex.Ready(rank, runner.kv_block_bytes, runner.weight_bytes(), pieces))
    model = runner.model
    sent = None  # the residual stream on its way to the next stage
    with torch.inference_mode():
        while True:
            message = channel.recv()
            if isinstance(message, ex.Forward):
                ids, positions, meta = ex.decode_forward(message, runner.device, runner.block_size)
                hidden = None
                if not stage.first:
                    hidden = torch.empty(len(ids), model_config.hidden_size, dtype=runner.dtype)
                    stage.recv(hidden, stage.stage - 1)
                # data-parallel attention: its own sequences, every rank's token counts
                group.rank_tokens = message.rank_tokens
                # (its part of the collectives)
                hidden = model(ids, positions, runner.kv_caches, meta, hidden)
                if message.rank_tokens is not None:  # its hidden states to rank 0
                    group.gather_rows(hidden)
                    continue
                if sent is not None:  # the step before's (Gloo's complete once waited on)
                    wait(sent)
                    sent = None
                if not stage.last:
                    sent = stage.send(hidden, stage.stage + 1)
                elif stage.size > 1 and stage.tp_rank == 0:
                    sent = stage.send(hidden, 0)  # to rank 0, which samples
            elif isinstance(message, ex.Logits):
                if stage.first:  # the head's stage
                    model.compute_logits(message.hidden.value().to(runner.device))
            elif isinstance(message, ex.AllocateKV):
                if message.shm_path is None:
                    runner.allocate_kv_cache(message.num_blocks)
                else:
                    offsets = message.rank_offsets[rank - 1]
                    runner.map_kv_cache(message.num_blocks, message.shm_path, offsets)
            elif isinstance(message, ex.ExpertCounts):
                counts = [counts for _, counts in runner.expert_tokens()]
                channel.send(ex.Counts(rank, counts))
            elif isinstance(message, ex.Stop):
                break
    runner.close()


class Channel:
    """This rank's messages to and from rank 0, and the store the process group forms
    through: on rank 0's node an ipc socket and a file store; on another node a CURVE
    socket whose address and the store are at the head (ember.distributed.nodes)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.context = zmq.Context()
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ex.ToRank)
        self.link: Link | None = None
        if args.dist_init_addr is None:
            import torch.distributed as dist

            self.store = dist.FileStore(args.store, args.size)
        else:
            self.store = node_store(Nodes(args.size, args.nnodes, args.dist_init_addr), args.rank)
        if args.socket is not None:
            self.socket = self.context.socket(zmq.PAIR)
            self.socket.connect(args.socket)
        else:  # the socket rank 0 bound for this rank (the store waits for it)
            address = self.store.get(STORE_KEY.format(rank=args.rank)).decode()
            self.link = Link.connect(self.context, node_secret(), address)
            self.socket = self.link.socket

    def send(self, message, block: bool = True) -> None:
        frame = self.encoder.encode(message)
        if self.link is None or not block:
            self.socket.send(frame, 0 if block else zmq.NOBLOCK)
            return
        while True:  # a PAIR socket blocks until its peer is there: watch the link
            try:
                return self.socket.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                self._check()
                self.socket.poll(200, zmq.POLLOUT)

    def _check(self) -> None:
        if self.link.poll() is not None:
            raise ex.RankFailedError(self.link.down)

    def recv(self):
        """The next call; on another node, RankFailedError once rank 0 is gone."""
        while self.link is not None and not self.socket.poll(200):
            self._check()
        return self.decoder.decode(self.socket.recv())

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        else:
            self.socket.close(linger=1000)
        self.context.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ember-rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--store", help="the process group's file store (rank 0's node)")
    parser.add_argument("--socket", help="zmq address of rank 0 (on its node)")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--dist-init-addr", help="HOST:PORT of rank 0's store (several nodes)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    startup.hold_collector()  # until its model is loaded (serve)
    logging.basicConfig(
        level=envs.log_level(),
        format=f"%(asctime)s %(levelname)s %(name)s[rank {args.rank}]: %(message)s",
    )
    _die_with_parent()
    channel = None
    try:
        channel = Channel(args)
        serve(args.rank, args, channel)
        return 0
    except Exception as exc:
        logger.error("rank %d failed: %s: %s", args.rank, type(exc).__name__, exc,
                     exc_info=not isinstance(exc, ex.RankFailedError))  # fmt: skip
        if channel is not None:
            with contextlib.suppress(zmq.ZMQError):  # rank 0 may be gone
                channel.send(ex.Failed(args.rank, f"{type(exc).__name__}: {exc}"), block=False)
        return 1
    finally:
        if channel is not None:
            channel.close()


if __name__ == "__main__":
    code = main()
    # leave without running the C++ destructors: the process group's threads (Gloo, the
    # TCPStore client) are still joinable then, and a joinable std::thread's destructor
    # aborts the process ("terminate called without an active exception", exit 250);
    # the channel is closed, nothing is left to clean up
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
