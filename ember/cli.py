"""The `ember` command."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from ember import envs, startup
from ember.engine_args import add_engine_args, add_kv_args, engine_options

if TYPE_CHECKING:
    from ember.engine.core_client import EngineCoreClient


def cmd_download(args: argparse.Namespace) -> int:
    from ember.loader.default_models import resolve_model

    print(resolve_model(args.model))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from ember import LLM, SamplingParams

    llm = LLM(args.model, **engine_options(args))
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate([args.prompt], params)[0]
    print(out.outputs[0].text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from ember.engine.core_client import EngineDeadError
    from ember.server.run import serve

    if args.node_rank:  # another node's ranks of the head's model: no API here
        from ember.config import EngineConfig
        from ember.distributed.nodes import Nodes, run_node

        config = EngineConfig(**engine_options(args))  # the layout checked as the head's
        return run_node(Nodes.of(config), args.node_rank)
    startup.hold_collector()  # until the server listens (http_server._started)
    try:
        return serve(args, engine_options(args), args.early_core)
    except EngineDeadError as exc:
        print(f"ember: error: {exc}", file=sys.stderr)
        return 1


def cmd_chat(args: argparse.Namespace) -> int:
    from ember.server.chat_client import run_chat

    return run_chat(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from ember.bench.offline import run_offline

    return run_offline(args)


def cmd_bench_startup(args: argparse.Namespace) -> int:
    from ember.bench.startup import run_startup

    return run_startup(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="Serve LLMs to agentic workloads.")
    sub = parser.add_subparsers(dest="command", required=True)

    download = sub.add_parser(
        "download", help="fetch a model (default: smollm2-135m) into the cache"
    )
    download.add_argument("model", nargs="?", default=None)
    download.set_defaults(func=cmd_download)

    generate = sub.add_parser("generate", help="generate once from a prompt, offline")
    add_engine_args(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--chat", action="store_true", help="apply the chat template")
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.set_defaults(func=cmd_generate)

    serve = sub.add_parser(
        "serve",
        help="serve the OpenAI API (default: smollm2-135m on 127.0.0.1:8000)",
    )
    add_engine_args(serve)
    add_kv_args(serve)
    from ember.server.args import add_server_args

    add_server_args(serve)
    serve.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="with --nnodes: this host's place; 0 is the head (the API and rank 0), any "
        "other runs only its share of the ranks (default %(default)s)",
    )
    serve.set_defaults(func=cmd_serve)

    router = sub.add_parser(
        "router", help="one OpenAI endpoint in front of workers (affinity, prefix, load)"
    )
    from ember.router.run import add_router_args, run_router

    add_router_args(router)
    router.set_defaults(func=run_router)

    up = sub.add_parser("up", help="a router and its workers on this machine, in one command")
    add_engine_args(up)
    add_kv_args(up, role=False)
    from ember.router.up import add_up_args, run_up

    add_up_args(up)
    up.set_defaults(func=lambda args: run_up(args, engine_options(args)))

    chat = sub.add_parser("chat", help="chat with a running server in the terminal")
    from ember.server.chat_client import add_chat_args

    add_chat_args(chat)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from ember.bench import commands

    serve_bench = bench_sub.add_parser(
        "serve", help="load an OpenAI-compatible server: random, agentic or trace workloads"
    )
    commands.add_serve_args(serve_bench)
    serve_bench.set_defaults(func=commands.run_serve)

    offline = bench_sub.add_parser("offline", help="engine throughput, no HTTP")
    add_engine_args(offline)
    commands.add_offline_args(offline)
    offline.set_defaults(func=cmd_bench)

    startup_bench = bench_sub.add_parser(
        "startup",
        help="cold start of `ember serve`: spawn to ready to first chat completion, by phase",
    )
    commands.add_startup_args(startup_bench)
    startup_bench.set_defaults(func=cmd_bench_startup)

    compare = bench_sub.add_parser("compare", help="runs side by side, with ratios")
    commands.add_compare_args(compare)
    compare.set_defaults(func=commands.run_compare)

    plan = sub.add_parser(
        "plan",
        help="how many prefill and decode workers a trace needs to meet TTFT/ITL targets",
    )
    from ember.plan.command import add_plan_args

    add_plan_args(plan)
    return parser


def early_core(argv: list[str]) -> EngineCoreClient | None:
    """For `ember serve` (but another node's ranks, or its help): its engine core, started
    before the flags are read (EngineCoreClient(None)), since importing torch is most of
    a start; None for any other command. (Flags that fail their checks stop it again.)"""
    if argv[:1] != ["serve"] or any(
        arg in ("-h", "--help") or arg.startswith("--node-rank") for arg in argv
    ):
        return None
    from ember.engine.core_client import EngineCoreClient

    return EngineCoreClient(None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    core = early_core(argv)
    logging.basicConfig(
        level=envs.log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every request at INFO
    args = build_parser().parse_args(argv)
    args.early_core = core
    startup.mark("args")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"ember: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
