"""A rank > 0 of a tensor-parallel model: `python -m ember.distributed.rank_worker`.

Started by rank 0's MultiprocExecutor (see there for the protocol). Builds and loads its
shard of the model as rank 0 does (ModelRunner, in `building(group)`), then makes every
model call rank 0 sends, on its shard, until `Stop`. Dies with its parent (SIGKILL), and
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
    import torch.distributed as dist

    from ember.config import EngineConfig, ModelConfig
    from ember.distributed.parallel import TPGroup
    from ember.distributed.shm_comm import ShmCommunicator
    from ember.engine.model_runner import ModelRunner
    from ember.loader.checkpoint import open_checkpoint
    from ember.loader.default_models import resolve_model

    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ex.ToRank)
    os.sched_setaffinity(0, ex.rank_cores(args.size, rank))
    torch.set_num_threads(args.threads)
    socket.send(encoder.encode(ex.Hello(rank)))
    dist.init_process_group(
        "gloo", init_method=f"file://{args.store}", rank=rank, world_size=args.size,
        timeout=ex.JOIN_TIMEOUT,
    )  # fmt: skip
    config = msgspec.json.decode(args.config.encode(), type=EngineConfig)
    group = TPGroup(rank, args.size, ShmCommunicator(), config.expert_parallel)
    torch.manual_seed(config.seed)
    checkpoint = open_checkpoint(resolve_model(config.model))
    model_config = ModelConfig.from_hf(checkpoint.hf_config)
    runner = ModelRunner(config, model_config, checkpoint, args.max_model_len, group=group)
    socket.send(encoder.encode(ex.Ready(rank, runner.kv_block_bytes, runner.weight_bytes())))
    model = runner.model
    with torch.inference_mode():
        while True:
            message = decoder.decode(socket.recv())
            if isinstance(message, ex.Forward):
                ids, positions, meta = ex.decode_forward(message, runner.device, runner.block_size)
                model(ids, positions, runner.kv_caches, meta)  # its part of the collectives
            elif isinstance(message, ex.Logits):
                model.compute_logits(message.hidden.value().to(runner.device))
            elif isinstance(message, ex.AllocateKV):
                runner.allocate_kv_cache(message.num_blocks)
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
