"""What loading a model costs in process: `EngineCore.from_config`'s seconds, its weights
and packing phases, the weights it holds, and the process's resident and peak memory
after loading (VmRSS / VmHWM). Run it once per process, alternating the forms compared.

    python benchmarks/load_memory.py [MODEL] [--keep-table]

--keep-table: the embedding table read and kept as floats, as where a drafter reads it
(weights_from_blocks' `table_shared`), instead of looked up in the file's blocks.
"""

from __future__ import annotations

import argparse
import gc
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--keep-table", action="store_true")
    args = parser.parse_args()
    gc.disable()  # as a server process starts (ember.startup.hold_collector)
    from ember import startup
    from ember.config import EngineConfig
    from ember.engine.core import EngineCore
    from ember.loader.default_models import resolve_model
    from ember.models import llama

    if args.keep_table:
        decide = llama.LlamaForCausalLM.weights_from_blocks
        llama.LlamaForCausalLM.weights_from_blocks = (
            lambda self, kernels, bf16, table_shared=False: decide(self, kernels, bf16, True)
        )
    start = time.perf_counter()
    core = EngineCore.from_config(EngineConfig(model=str(resolve_model(args.model))))
    took = time.perf_counter() - start
    ends = {phase: at for phase, at, _ in startup.marks()}
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    print(
        "keep-table" if args.keep_table else "blocks",
        f"from_config {took:.3f} s",
        f"weights {ends['weights'] - ends['model built']:.3f} s",
        f"packed {ends['packed'] - ends['weights']:.3f} s",
        f"weights held {core.runner.weight_bytes() / 1e6:.0f} MB",
        f"RSS {int(status['VmRSS'].split()[0]) >> 10} MB",
        f"peak {int(status['VmHWM'].split()[0]) >> 10} MB",
    )
    core.close()


if __name__ == "__main__":
    main()
