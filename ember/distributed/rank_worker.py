"""A rank > 0 of a tensor-parallel model: `python -m ember.distributed.rank_worker`.

Started by rank 0's MultiprocExecutor (see there for the protocol). Builds and loads its
shard of the model as rank 0 does (ModelRunner, in `building(group)`), then makes every
model call rank 0 sends, on its shard, until `Stop`: a later pipeline stage receives the
previous stage's residual stream first, and every stage but the last sends its own on
(the last stage's rank 0 sends it back to rank 0). Dies with its parent (SIGKILL), and
tells rank 0 why before it exits on an error.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import msgspec
import zmq

from ember import envs
from ember.distributed import executor as ex
from ember.engine.core_proc import die_with_parent

logger = logging.getLogger("ember.distributed")


def _die_with_parent() -> None:
    """SIGKILL when rank 0 dies: a rank holds nothing worth a clean exit."""
    die_with_parent(signal.SIGKILL)


def serve(rank: int, args: argparse.Namespace, socket: zmq.Socket) -> None:
    import torch

    from ember.config import EngineConfig, ModelConfig
    from ember.distributed.parallel import wait
    from ember.engine.model_runner import ModelRunner
    from ember.loader.checkpoint import open_checkpoint
    from ember.loader.default_models import resolve_model

    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ex.ToRank)
    os.sched_setaffinity(0, ex.rank_cores(args.size, rank))
    torch.set_num_threads(args.threads)
    socket.send(encoder.encode(ex.Hello(rank)))
    config = msgspec.json.decode(args.config.encode(), type=EngineConfig)
    group, stage = ex.join_group(rank, config, args.store)
    torch.manual_seed(config.seed)
    checkpoint = open_checkpoint(resolve_model(config.model))
    model_config = ModelConfig.from_hf(checkpoint.hf_config)
    runner = ModelRunner(
        config, model_config, checkpoint, args.max_model_len, group=group, stage=stage
    )
    pieces = [tuple(piece) for piece in runner.kv_pieces]
    socket.send(
        encoder.encode(ex.Ready(rank, runner.kv_block_bytes, runner.weight_bytes(), pieces))
    )
    model = runner.model
    sent = None  # the residual stream on its way to the next stage
    with torch.inference_mode():
        while True:
            message = decoder.decode(socket.recv())
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
                socket.send(encoder.encode(ex.Counts(rank, counts)))
            elif isinstance(message, ex.Stop):
                break
    runner.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ember-rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--store", required=True, help="the process group's file store")
    parser.add_argument("--socket", required=True, help="zmq address of rank 0")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=envs.log_level(),
        format=f"%(asctime)s %(levelname)s %(name)s[rank {args.rank}]: %(message)s",
    )
    _die_with_parent()
    context = zmq.Context()
    socket = context.socket(zmq.PAIR)
    socket.connect(args.socket)
    try:
        serve(args.rank, args, socket)
        return 0
    except Exception as exc:
        logger.exception("rank %d failed", args.rank)
        socket.send(msgspec.msgpack.encode(ex.Failed(args.rank, f"{type(exc).__name__}: {exc}")))
        return 1
    finally:
        socket.close(linger=1000)
        context.term()


if __name__ == "__main__":
    sys.exit(main())
