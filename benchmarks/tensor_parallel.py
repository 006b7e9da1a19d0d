"""One model over 1 or 2 processes (tensor or pipeline parallel): decode step time, output
tokens per second, the share of rank 0's step spent in collectives, and each rank's peak RSS.

    python benchmarks/tensor_parallel.py [--model smollm2-135m] [--batch 1 4] [--tokens 64]
    python benchmarks/tensor_parallel.py --moe DIR   # a random ~2 GB Qwen3-MoE, EP=2, TP=2
    python benchmarks/tensor_parallel.py --pipeline --batch 4 8   # PP=2, 1 or 2 steps in flight
    python benchmarks/tensor_parallel.py --moe DIR --data-parallel-attention --batch 2 8
    python benchmarks/tensor_parallel.py --nodes   # TP=2 on one node, then over two

`--pipeline` runs PP=2 (one core per stage) instead of TP=2, once with a step at a time
(EMBER_PIPELINE_STEPS_IN_FLIGHT=1: the stages take turns) and once with two steps in
flight (the default: the running requests split over two steps, the first stage running
one while the second runs the other). Its "step ms" is the engine's mean time from a
step's submission to its tokens, and "in coll." the share of rank 0's time spent waiting
for the last stage's hidden states.

`--moe DIR` builds (once) a random-init Qwen3-MoE of about 2 GB in DIR (8 layers of 32
experts, 8 a token) and runs two ranks twice: experts split by expert (EP=2) and each
expert's width split (TP=2, tensor parallel within the experts). With
`--data-parallel-attention` it runs EP=2 with attention split by head, then attention
data-parallel (each rank its own sequences) with the experts reached by all-gather +
reduce-scatter and by all-to-all, and with each expert's width split (all-gather); "in
coll." then counts the row collectives too.

`--nodes` runs TP=2 on one node (all-reduce in shared memory), then over two nodes on
loopback (`--nnodes 2`: rank 1 started by `ember serve --node-rank 1`, each node pinned
to one core, the all-reduces over Gloo's TCP as between hosts, the calls over CURVE),
then PP=2 (two steps in flight) on one node and over two.

Each configuration runs in a fresh process (peak RSS of its own): TP=1 on one thread,
TP=1 on as many threads as TP=2 has cores, TP=2 with one core per rank. Per batch size:
`batch` prompts of ~40 tokens, greedy, `tokens` new tokens each (ignore_eos), after a
warm-up of the same shape; "step ms" is the engine's own mean step time (one prefill
step, then decode steps). "in collectives" is rank 0's time inside all-reduce / all-gather,
which includes waiting for the slower rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _peak_rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_one(args: argparse.Namespace) -> dict:
    import torch

    from ember import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    comm_s = [0.0]
    nodes = {}
    if args.nnodes > 1:
        nodes = {"nnodes": args.nnodes, "dist_init_addr": start_node(args)}
    llm = LLM(args.model, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, **nodes,
              max_model_len=1024, kv_cache_memory=256 << 20, max_step_ms=0,
              expert_parallel=args.expert_parallel,
              data_parallel_attention=args.dispatch is not None,
              moe_dispatch=args.dispatch or "auto")  # fmt: skip
    runner = llm.engine.core.runner
    if args.pp > 1:
        from ember.distributed.executor import PendingHidden

        result_of = PendingHidden.result

        def waited(pending):
            start = time.perf_counter()
            out = result_of(pending)
            comm_s[0] += time.perf_counter() - start
            return out

        PendingHidden.result = waited
    elif args.tp > 1:
        comm = runner.group.comm
        names = ("all_reduce", "all_gather", "all_gather_rows", "reduce_scatter_rows",
                 "all_to_all_rows")  # fmt: skip
        for name in names:
            call = getattr(comm, name)

            def timed(*tensors, call=call):
                start = time.perf_counter()
                out = call(*tensors)
                comm_s[0] += time.perf_counter() - start
                return out

            setattr(comm, name, timed)
    tokenizer = llm.get_tokenizer()
    text = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    result = {"tp": args.tp, "pp": args.pp, "threads": args.threads, "batches": {}}
    for batch in args.batch:
        if args.token_ids:  # the random MoE (--moe) has no tokenizer
            prompts = [[(7 * j + i) % 1000 + 5 for j in range(20)] for i in range(batch)]
        else:
            prompts = [tokenizer.encode(f"{i}. {text}") for i in range(batch)]
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts, params)  # warm-up
        stats = llm.engine.stats()
        steps0, seconds0, comm0 = stats.num_steps, stats.step_seconds, comm_s[0]
        start = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - start
        stats = llm.engine.stats()
        steps = stats.num_steps - steps0
        step_s = stats.step_seconds - seconds0
        result["batches"][batch] = {
            "tok_s": batch * args.tokens / wall,
            "step_ms": 1e3 * step_s / steps,
            "comm_share": (comm_s[0] - comm0) / step_s,
        }
    ranks = [os.getpid()]
    if runner.executor is not None:
        ranks += [p.pid for p in runner.executor._processes]
    result["peak_rss_mb"] = [_peak_rss_mb(pid) for pid in ranks]
    result["weight_mb"] = [runner.weight_bytes() / 1e6] + [
        b / 1e6 for b in (runner.executor.rank_weight_bytes if runner.executor else [])
    ]
    llm.close()
    return result


def start_node(args: argparse.Namespace) -> str:
    """Node 1 of two on loopback, on the last core (this process keeps the first); the
    head's address."""
    import secrets
    import socket

    os.environ.setdefault("EMBER_CLUSTER_SECRET", secrets.token_hex(16))
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[:1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    command = ["taskset", "-c", str(cores[-1]), sys.executable, "-m", "ember.cli", "serve",
               "--nnodes", str(args.nnodes), "--node-rank", "1", "--dist-init-addr", addr,
               "-tp", str(args.tp), "-pp", str(args.pp)]  # fmt: skip
    subprocess.Popen(command, stdout=subprocess.DEVNULL)  # exits when the head stops
    return addr


def build_moe(directory: str) -> str:
    """A random-init Qwen3-MoE of about 2 GB (fp32), saved once in `directory`."""
    from pathlib import Path

    if (Path(directory) / "config.json").exists():
        return directory
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, moe_intermediate_size=512,
        num_experts=32, num_experts_per_tok=8, decoder_sparse_step=1, norm_topk_prob=True,
        tie_word_embeddings=False, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--moe", default=None, help="build and run a random MoE in this dir")
    parser.add_argument("--expert-parallel", action="store_true", help="(internal)")
    parser.add_argument("--token-ids", action="store_true", help="(internal) prompts as ids")
    parser.add_argument(
        "--data-parallel-attention",
        action="store_true",
        help="with --moe: attention data-parallel, each MoE dispatch",
    )
    parser.add_argument("--dispatch", default=None, help="(internal) moe_dispatch")  # fmt: skip
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--pipeline", action="store_true", help="PP=2 instead of TP=2")
    parser.add_argument("--tp", type=int, default=None, help="(internal) one configuration")
    parser.add_argument("--pp", type=int, default=1, help="(internal)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--nodes", action="store_true", help="TP=2 on one node, then two")
    parser.add_argument("--nnodes", type=int, default=1, help="(internal)")
    args = parser.parse_args()
    if args.tp is not None:
        print(json.dumps(run_one(args)))
        return
    if args.moe is not None:
        args.model = build_moe(args.moe)
    cores = len(os.sched_getaffinity(0))
    # (tp, pp, threads per rank, steps in flight or "nodes", expert parallel,
    # data-parallel dispatch)
    configs = [(1, 1, 1, None, False, None), (1, 1, min(2, cores), None, False, None)]
    if args.nodes:
        configs = [(2, 1, 1, None, False, None), (2, 1, 1, "nodes", False, None),
                   (1, 2, 1, 2, False, None), (1, 2, 1, "nodes", False, None)]  # fmt: skip
    elif args.pipeline:
        configs += [(1, 2, 1, 1, False, None), (1, 2, 1, 2, False, None)]
    elif args.data_parallel_attention:
        configs += [(2, 1, 1, None, True, None), (2, 1, 1, None, True, "all-gather"),
                    (2, 1, 1, None, True, "all-to-all"), (2, 1, 1, None, False, "all-gather")]  # fmt: skip
    else:
        configs += [(2, 1, 1, None, True, None)] if args.moe is not None else []
        configs += [(2, 1, 1, None, False, None)]
    print(f"model {args.model}, {args.tokens} new tokens, {cores} cores")
    print(f"{'config':<30} {'batch':>5} {'tok/s':>8} {'step ms':>8} {'in coll.':>8}  "
          "peak RSS MB per rank / weights MB")  # fmt: skip
    for tp, pp, threads, in_flight, by_expert, dispatch in configs:
        command = [sys.executable, __file__, "--model", args.model, "--tp", str(tp),
                   "--pp", str(pp), "--threads", str(threads), "--tokens", str(args.tokens),
                   "--batch", *map(str, args.batch)]  # fmt: skip
        command += ["--token-ids"] if args.moe is not None else []
        command += ["--expert-parallel"] if by_expert else []
        command += ["--dispatch", dispatch] if dispatch else []
        env = dict(os.environ)
        if in_flight == "nodes":
            command += ["--nnodes", "2"]
        elif in_flight is not None:
            env["EMBER_PIPELINE_STEPS_IN_FLIGHT"] = str(in_flight)
        out = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if pp > 1:
            name = f"PP={pp}, {in_flight} in flight"
            if in_flight == "nodes":
                name = f"PP={pp} over 2 nodes (Gloo)"
        else:
            kind = "EP" if by_expert else "TP"
            name = f"{kind}={tp} ({threads} thr{'/rank' if tp > 1 else ''})"
            if dispatch:
                name = f"DP-attn {kind}={tp} {dispatch}"
            if in_flight == "nodes":
                name = f"TP={tp} over 2 nodes (Gloo)"
        for batch, row in result["batches"].items():
            rss = " ".join(f"{mb:.0f}" for mb in result["peak_rss_mb"])
            weights = " ".join(f"{mb:.0f}" for mb in result["weight_mb"])
            print(f"{name:<30} {batch:>5} {row['tok_s']:>8.1f} {row['step_ms']:>8.2f} "
                  f"{row['comm_share']:>8.0%}  {rss} / {weights}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
