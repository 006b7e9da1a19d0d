"""The command line's engine options: the flags every command that runs a model takes
(`add_engine_args`, with the KV hand-off's in `add_kv_args`) and the EngineConfig keywords
they stand for (`engine_options`). ember.cli builds its commands from them; so do `ember
bench` and the router's and deployment's tests."""

from __future__ import annotations

import argparse

from ember import envs
from ember.units import parse_bytes


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF directory, .gguf file or alias (default: smollm2-135m)",
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that runs a model."""
    from ember.config import (
        KV_CACHE_DTYPES,
        SCHEDULING_POLICIES,
        SPECULATIVE_METHODS,
        EngineConfig,
    )

    d = EngineConfig()
    add_model_arg(parser)
    parser.add_argument(
        "--dtype",
        default=d.dtype,
        help="auto (fp32 on CPU, bf16 on CUDA; the default) | float32 | bfloat16 | float16",
    )
    parser.add_argument("--device", default=d.device, help="auto (the default) | cpu | cuda[:N]")
    parser.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        help="tokens per KV block (default %(default)s)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="KV cache size, e.g. 2G (default: from free memory)",
    )
    parser.add_argument(
        "--max-rank-memory",
        type=parse_bytes,
        default=None,
        help="the memory one process (rank) may take for its weights and KV cache, e.g. 8G: "
        "a model whose share does not fit is refused before its weights are read (name more "
        "ranks with --tensor-parallel-size); the KV cache gets what the weights leave",
    )
    parser.add_argument(
        "--kv-offload-memory",
        type=parse_bytes,
        default=None,
        help="host memory for KV blocks that leave the cache, e.g. 8G (default: none)",
    )
    parser.add_argument(
        "--kv-disk-dir",
        default=None,
        help="a directory where KV blocks are kept on disk, across restarts (default: none)",
    )
    parser.add_argument(
        "--kv-disk-size",
        type=parse_bytes,
        default=d.kv_disk_size,
        help="bytes of KV blocks kept in --kv-disk-dir, e.g. 100G (default: 16G)",
    )
    parser.add_argument(
        "--kv-store",
        default=None,
        help="a Mooncake Store every worker shares, mooncake://MASTER_HOST:PORT (needs "
        "$EMBER_CLUSTER_SECRET; `ember up --kv-store mooncake` starts one) (default: none)",
    )
    parser.add_argument(
        "--kv-store-memory",
        type=parse_bytes,
        default=0,
        help="memory this worker adds to the Mooncake Store's pool, e.g. 4G (default: 0)",
    )
    parser.add_argument(
        "--kv-connectors",
        type=lambda text: tuple(name.strip() for name in text.split(",") if name.strip()),
        default=d.kv_connectors,
        help="the KV connectors to run, in order: disagg, tiers, or module:factory of your "
        "own (default: disagg,tiers)",
    )
    parser.add_argument(
        "--kv-save",
        choices=("computed", "finished", "evicted"),
        default=d.kv_save,
        help="when computed KV blocks are copied into the tiers: as soon as computed "
        "(write-through), when their request finishes, or when the pool evicts them "
        "(write-back) (default %(default)s)",
    )
    parser.add_argument(
        "--session-ttl",
        type=float,
        default=d.session_ttl,
        help="seconds an agent session's KV blocks (x-session-affinity or kv_retention "
        "'session') stay protected from eviction on disk after their last use "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length served (default: the model's)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="token budget per step (default %(default)s)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="run the model over this many processes on this host (tensor parallel: each "
        "holds its share of the weights and KV heads, and of the cores; --kv-cache-memory "
        "is per process) (default %(default)s)",
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=d.pipeline_parallel_size,
        help="split the model's layers over this many stages of --tensor-parallel-size "
        "processes each (pipeline parallel: each stage a range of layers and their KV "
        "cache; one step in flight per stage) (default %(default)s)",
    )
    parser.add_argument(
        "--expert-parallel",
        action="store_true",
        help="with --tensor-parallel-size: split mixture-of-experts layers by expert (each "
        "process a range of the experts, whole) rather than within each expert (each "
        "process a share of every expert's width)",
    )
    parser.add_argument(
        "--data-parallel-attention",
        action="store_true",
        help="with --tensor-parallel-size N and a mixture-of-experts model: each process "
        "holds the whole model but the experts and runs attention for its own sequences, "
        "keeping only their KV cache (N times the sequences of MLA's latent cache); the "
        "experts split as above",
    )
    parser.add_argument(
        "--moe-dispatch",
        choices=("auto", "all-gather", "all-to-all"),
        default=d.moe_dispatch,
        help="with --data-parallel-attention: how tokens reach the experts' processes "
        "(all-to-all needs --expert-parallel) (default %(default)s: all-gather)",
    )
    parser.add_argument(
        "--nnodes",
        type=int,
        default=d.nnodes,
        help="run the model's ranks over this many hosts, an equal share each; the head "
        "(node 0) serves the API, every other host runs `ember serve --nnodes N "
        "--node-rank K --dist-init-addr HEAD:PORT` with the same parallel flags; every "
        "node needs $EMBER_CLUSTER_SECRET and the model (default %(default)s)",
    )
    parser.add_argument(
        "--dist-init-addr",
        default=None,
        metavar="HOST:PORT",
        help="with --nnodes: where the head's rank 0 listens for the other nodes' ranks",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help="sequences per step (default %(default)s)",
    )
    parser.add_argument(
        "--max-prefill-step-tokens",
        type=int,
        default=d.max_prefill_step_tokens,
        help="with no sequence decoding, a step may take up to this many tokens (within "
        "--max-step-ms) for prompts that then finish their prefill in it (one step for a "
        "burst of prompts, not two); at most --max-num-batched-tokens turns it off "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--batch-wait-ms",
        type=float,
        default=d.batch_wait_ms,
        help="an idle engine that gets a request while the server is still tokenizing "
        "others waits up to this long for them, so that requests that came together share "
        "a step; 0: never waits (default %(default)s)",
    )
    parser.add_argument(
        "--max-step-ms",
        type=float,
        default=d.max_step_ms,
        help="step budget: while sequences decode, shrink prefill chunks so that a step is "
        "predicted (from the steps timed so far) to take at most this long, which bounds "
        "inter-token latency; 0 turns it off (default %(default)s)",
    )
    parser.add_argument(
        "--target-itl-ms",
        type=_ms_or_auto,
        default="auto",
        help="while sequences decode, a prompt chunk that would keep their next token past "
        "this many ms after their last runs its layers a slice at a time, and the decodes "
        "take steps of their own between slices whenever the next slice would pass it: "
        "lower inter-token latency under long prompts, for some time to first token; 0 "
        "turns it off; auto: 0.85 of the time a 512-token prompt takes on this machine, "
        "as the step cost model predicts it (one process on CPU, no speculative "
        "decoding; default %(default)s)",
    )
    parser.add_argument(
        "--min-prefill-tokens",
        type=int,
        default=d.min_prefill_tokens,
        help="the step budget never cuts a step's prefill below this (default %(default)s)",
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=d.scheduling_policy,
        help="which prompt gets a step's prefill tokens first: fcfs (arrival order) or "
        "shortest (the highest response ratio, (wait + prefill left) / prefill left: "
        "short prompts pass long ones, and a prompt's turn comes as it waits) "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--speculative-method",
        default=None,
        choices=SPECULATIVE_METHODS,
        help="speculative decoding: propose draft tokens and verify them in one step "
        "(ngram: prompt lookup in the request's own tokens; draft: a smaller model, "
        "--speculative-model; eagle3: an EAGLE-3 head, --speculative-model; mtp: the "
        "model's own multi-token-prediction layer, DeepSeek-V3 / Kimi K2); default off",
    )
    parser.add_argument(
        "--speculative-model",
        default=None,
        help="--speculative-method draft: the draft model (an alias, a Hugging Face "
        "directory or a GGUF file) with this model's tokenizer; eagle3: the EAGLE-3 head's "
        "directory (config.json and safetensors, as SGLang and vLLM load them)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=d.num_speculative_tokens,
        help="most draft tokens per request and step (default %(default)s)",
    )
    parser.add_argument(
        "--no-speculative-adaptive",
        action="store_true",
        help="always propose --num-speculative-tokens drafts (by default a request whose "
        "drafts are rejected gets fewer, down to none for a while, and each step keeps the "
        "drafts that pay at its batch size, by measured step times)",
    )
    parser.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        help="no drafts in a step where at least this many sequences decode (drafts cost "
        "compute a larger batch may not have to spare: a draft model, verification rows)",
    )
    parser.add_argument(
        "--prompt-lookup-min",
        type=int,
        default=d.prompt_lookup_min,
        help="ngram: the shortest suffix looked up (default %(default)s)",
    )
    parser.add_argument(
        "--prompt-lookup-max",
        type=int,
        default=d.prompt_lookup_max,
        help="ngram: the longest suffix looked up (default %(default)s)",
    )
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    parser.add_argument(
        "--attention-backend",
        default=d.attention_backend,
        help="auto (the default) | sdpa | cpu-paged",
    )
    parser.add_argument(
        "--matmul-precision",
        default=d.matmul_precision,
        choices=envs.MATMUL_PRECISIONS,
        help="CPU steps of 16+ tokens: ieee (exact fp32), bf16 (weights packed once in bf16, "
        "bf16 activations, on AMX / AVX-512 BF16: 1.6-4x faster prefill; refused on CPUs "
        "without them; smaller decode batches stay fp32), int8 (a GGUF file's blocks that "
        "tile multiply every row on int8 activations, as decode does) or auto (the default, "
        "or $EMBER_MATMUL_PRECISION: bf16 on AMX, else int8 where the tiles sum on AVX512-VNNI "
        "for a file mostly in such blocks, "
        "else bf16 on AMD's AVX-512 BF16, else ieee prefill)",
    )
    parser.add_argument(
        "--decode-activations",
        default=d.decode_activations,
        choices=("auto", "fp32", "int8"),
        help="CPU one-row decode steps on a GGUF file's blocks: fp32 (exact), int8 (activations "
        "rounded to int8 per 32 values, integer products, as llama.cpp does) or auto (the "
        "default: int8 unless --matmul-precision is ieee, on x86)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="the KV cache's element type: float32, bfloat16 (half the bytes: twice the "
        "tokens per GB, half the bytes decode attention reads) or auto (the default: bfloat16 "
        "where prefill runs in bf16, see --matmul-precision; else float32 on CPU, the "
        "model's dtype on CUDA)",
    )
    parser.add_argument(
        "--no-gguf-blocks",
        action="store_true",
        help="decode from the fp32 weights even when a GGUF file's Q4_0 / Q4_1 / Q5_0 / "
        "Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks (which decode to the same weights, bit for bit) would be 2-3x faster on CPU",
    )
    parser.add_argument(
        "--seed", type=int, default=d.seed, help="seed for unseeded sampling (default %(default)s)"
    )


def _ms_or_auto(text: str) -> float | str:
    """--target-itl-ms: "auto" or milliseconds (>= 0: EngineConfig checks)."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds or 'auto', got {text!r}") from None


def add_kv_args(parser: argparse.ArgumentParser, role: bool = True) -> None:
    """Disaggregation: the worker's role and how KV blocks move (the cluster's secret:
    $EMBER_CLUSTER_SECRET)."""
    from ember.config import EngineConfig

    d = EngineConfig()
    group = parser.add_argument_group("disaggregation (KV connector)")
    if role:
        group.add_argument(
            "--role",
            default=d.kv_role,
            choices=["mixed", "prefill", "decode"],
            help="mixed (the default) runs whole requests; prefill hands the KV of finished "
            "prompts to decode workers; decode continues them (any role serves whole requests)",
        )
    group.add_argument(
        "--kv-transport",
        default=d.kv_transport,
        choices=["auto", "tcp", "shm", "mooncake", "fake"],
        help="how this worker fetches KV: auto (shared memory when the prefill worker is on "
        "this host, else TCP), tcp, shm, mooncake (optional install), fake (tests)",
    )
    group.add_argument(
        "--kv-host", default=d.kv_host, help="a prefill worker's KV endpoint (default %(default)s)"
    )
    group.add_argument(
        "--kv-port", type=int, default=d.kv_port, help="its port (default: any free one)"
    )
    group.add_argument(
        "--kv-hold-timeout",
        type=float,
        default=d.kv_hold_timeout,
        help="seconds a prefill worker keeps blocks no decode worker fetched (default %(default)s)",
    )
    group.add_argument(
        "--kv-load-timeout",
        type=float,
        default=d.kv_load_timeout,
        help="seconds a decode worker waits on a transfer before recomputing (default %(default)s)",
    )
    group.add_argument(
        "--kv-checksum", action="store_true", help="check every transfer with CRC-32"
    )
    group.add_argument(
        "--kv-fake-fault",
        default=None,
        help="the fake transport's fault: delay:SECONDS | drop | fail | corrupt (tests)",
    )


def kv_options(args: argparse.Namespace) -> dict:
    if not hasattr(args, "kv_transport"):
        return {}
    return dict(
        kv_role=getattr(args, "role", "mixed"),
        kv_transport=args.kv_transport,
        kv_host=args.kv_host,
        kv_port=args.kv_port,
        kv_hold_timeout=args.kv_hold_timeout,
        kv_load_timeout=args.kv_load_timeout,
        kv_checksum=args.kv_checksum,
        kv_fake_fault=args.kv_fake_fault,
    )


def engine_options(args: argparse.Namespace) -> dict:
    return dict(
        **kv_options(args),
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        max_rank_memory=args.max_rank_memory,
        kv_offload_memory=args.kv_offload_memory,
        kv_disk_dir=args.kv_disk_dir,
        kv_disk_size=args.kv_disk_size,
        kv_store=args.kv_store,
        kv_store_memory=args.kv_store_memory,
        session_ttl=args.session_ttl,
        kv_connectors=args.kv_connectors,
        kv_save=args.kv_save,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        expert_parallel=args.expert_parallel,
        data_parallel_attention=args.data_parallel_attention,
        moe_dispatch=args.moe_dispatch,
        nnodes=args.nnodes,
        dist_init_addr=args.dist_init_addr,
        max_step_ms=args.max_step_ms,
        target_itl_ms=None if args.target_itl_ms == "auto" else args.target_itl_ms,
        min_prefill_tokens=args.min_prefill_tokens,
        max_prefill_step_tokens=args.max_prefill_step_tokens,
        batch_wait_ms=args.batch_wait_ms,
        scheduling_policy=args.scheduling_policy,
        enable_prefix_caching=not args.no_prefix_caching,
        speculative_method=args.speculative_method,
        speculative_model=args.speculative_model,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_adaptive=not args.no_speculative_adaptive,
        speculative_disable_by_batch_size=args.speculative_disable_by_batch_size,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
        attention_backend=args.attention_backend,
        matmul_precision=args.matmul_precision,
        gguf_blocks=not args.no_gguf_blocks,
        decode_activations=args.decode_activations,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed,
    )
