"""KV hand-off cost per transport: bytes moved per request and load time (p50 / p90).

A prefill engine core in a process of its own (with its ranks, `--prefill-tp`) and a
decode engine core in this process (`--decode-tp` ranks); the transfer runs over a real
socket or shared memory, as between two workers: for each prompt length, N distinct
prompts are prefilled, handed over and decoded for one token; the decode core's
connector times each load (lease, bytes, release; and, where the two split the KV
otherwise, the copy of each head to its rank: ember.kv.layout). Both pools have their
pages before the first transfer (the decode core's taken here, as an idle worker's
core takes them; the prefill process's by its own idle loop).

    python benchmarks/kv_transfer.py [--model PATH] [--lengths 256,1024,2048] [-n 10]
        [--transports tcp,shm,mooncake] [--prefill-tp 1] [--decode-tp 1]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from ember.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.core_client import EngineCoreClient
from ember.engine.core_proc import KV_POLL_MS
from ember.engine.messages import EngineCoreOutputs, EngineCoreRequest
from ember.kv.params import KVTransferParams
from ember.loader.default_models import resolve_model
from ember.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


def run(core: EngineCore, request: EngineCoreRequest):
    """Steps the core as its process does: waiting (not spinning) while KV arrives."""
    core.add_request(request)
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
        if not core.has_runnable():
            time.sleep(KV_POLL_MS / 1000)
    return outputs


def prefill_remote(client: EngineCoreClient, request: EngineCoreRequest):
    """The prefill process's answer to `request`: where its blocks wait."""
    client.send(request)
    while True:
        message = client.recv(100)
        if isinstance(message, EngineCoreOutputs):
            for output in message.outputs:
                if output.request_id == request.request_id and output.finish_reason:
                    return output.kv_transfer_params


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--lengths", default="256,1024,2048")
    parser.add_argument("-n", type=int, default=10)
    parser.add_argument("--transports", default="tcp,shm,mooncake")
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("EMBER_CLUSTER_SECRET", "bench")
    base = dict(model=str(resolve_model(args.model)), kv_cache_memory=1 << 30,
                max_num_batched_tokens=2048)  # fmt: skip
    transports = args.transports.split(",")
    prefill_transport = "mooncake" if "mooncake" in transports else "auto"
    prefill = EngineCoreClient(EngineConfig(**base, kv_role="prefill", kv_transport=prefill_transport,
                                            tensor_parallel_size=args.prefill_tp))  # fmt: skip
    prefill.wait_ready()
    rng = random.Random(0)
    split = f"TP {args.prefill_tp} -> {args.decode_tp}"
    print("| split | transport | prompt tokens | MB / request | load p50 ms | load p90 ms "
          "| GB/s (p50) |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for transport in transports:
        decode = EngineCore.from_config(
            EngineConfig(
                **base,
                kv_role="decode",
                kv_transport=transport,
                tensor_parallel_size=args.decode_tp,
            )  # fmt: skip
        )
        while decode.has_idle_work():  # its pool's pages, as an idle worker takes them
            decode.idle_work()
        vocab = decode.model_config.vocab_size
        for length in map(int, args.lengths.split(",")):
            sizes = []
            start = len(decode.connector.stats.load_seconds)
            for i in range(args.n + 1):  # the first warms the transport up
                prompt = [rng.randrange(100, vocab) for _ in range(length)]
                kv = KVTransferParams(do_remote_decode=True)
                request = EngineCoreRequest(f"{transport}{length}p{i}", prompt, GREEDY, 1, [],
                                            kv_transfer=kv)  # fmt: skip
                remote = prefill_remote(prefill, request)
                before = decode.connector.stats.bytes_received
                kv = KVTransferParams(remote_prefill=remote)
                run(decode, EngineCoreRequest(f"d{i}", prompt, GREEDY, 2, [], kv_transfer=kv))
                sizes.append(decode.connector.stats.bytes_received - before)
            assert decode.connector.stats.loads_failed == 0, "a transfer failed"
            seconds = decode.connector.stats.load_seconds[start + 1 :]
            p50 = statistics.median(seconds)
            p90 = statistics.quantiles(seconds, n=10)[-1]
            mb = statistics.mean(sizes[1:]) / 1e6
            print(f"| {split} | {transport} | {length} | {mb:.1f} | {p50 * 1e3:.1f} | {p90 * 1e3:.1f} "
                  f"| {mb / 1e3 / p50:.2f} |", flush=True)  # fmt: skip
        decode.close()
    prefill.shutdown()


if __name__ == "__main__":
    main()
