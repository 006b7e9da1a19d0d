"""`ember serve`: start the engine core process, then the HTTP server in front of it.

The core is started first, before the flags are read (`ember.cli` starts it and this
hands it its config): it imports torch and loads the model while this process imports
the HTTP stack and loads the tokenizer
(`http_server.run_http`, which serves until SIGINT / SIGTERM).
"""

from __future__ import annotations

import argparse

from ember import startup
from ember.config import EngineConfig
from ember.engine.core_client import EngineCoreClient
from ember.server.args import check_serve_args


def serve(
    args: argparse.Namespace, engine_options: dict, core: EngineCoreClient | None = None
) -> int:
    """`core`: one started before the flags were read (EngineCoreClient(None)), handed its
    config here; else one is started here."""
    from ember.loader.default_models import resolve_model

    check_serve_args(args)  # before a core starts for nothing
    config = EngineConfig(model=str(resolve_model(args.model)), **engine_options)
    if core is None:
        core = EngineCoreClient(config)
    else:
        core.start(config)
    startup.mark("core configured")
    try:
        from ember.server.http_server import run_http

        startup.mark("server imported")
        return run_http(args, core)
    finally:
        core.shutdown()  # (already stopped, unless this process failed before serving)
