"""On a CUDA device: MoE experts as grouped GEMMs against a loop over the experts, and
the KV tiers' copies between the GPU's pool and pinned host memory.

    python benchmarks/gpu_moe_tiers.py --tokenizer DIR [--dir /tmp/ember-ds-gpu]

1. One MoE layer's experts in bf16 (`ember.models.moe.Experts`), in the shapes of
   DeepSeek-V2-Lite (hidden 2048, 64 experts of 1408, 6 a token) and Qwen3-30B-A3B
   (2048, 128 of 768, 8 a token): median milliseconds a call over 1 to 4,096 tokens, the
   grouped GEMM (`mode="grouped"`) against a matmul pair per expert (`mode="loop"`),
   timed with CUDA events.
2. The random-init DeepSeek-V3 of benchmarks/moe_mla.py (DeepSeek's ratios, 8 layers,
   64 experts) in bf16 on the GPU: decode tokens/s at each batch size, the same engine
   with its experts grouped and looped, and how many greedy tokens the two agree on.
3. The KV tiers: SmolLM2-135M's KV layout in bf16 on the GPU, N blocks saved into a
   pinned host tier and loaded back (`TieredStore.save` / `load`), against one plain
   device-to-host and host-to-device copy of the same bytes.
Prints a JSON line per measurement. `--tokenizer DIR`: any tokenizer files of a
49,152-token vocabulary (the default model's; `ember download` then `LLM(None)
.get_tokenizer().save_pretrained(DIR)`).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYERS = {  # name: (hidden, expert intermediate, experts, experts a token)
    "DeepSeek-V2-Lite": (2048, 1408, 64, 6),
    "Qwen3-30B-A3B": (2048, 768, 128, 8),
}


def cuda_ms(fn, repeats: int = 20) -> float:
    """Median milliseconds of fn() on the GPU (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def layer_times() -> None:
    from ember.model_config import MoEConfig
    from ember.models.moe import Experts

    torch.manual_seed(0)
    for name, (hidden_size, inter, experts, top_k) in LAYERS.items():
        config = MoEConfig(experts, top_k, inter, scoring="softmax", norm_topk_prob=True)
        layer = Experts(hidden_size, config).to("cuda", torch.bfloat16)
        with torch.no_grad():
            layer.gate_up_proj.normal_(std=0.02)
            layer.down_proj.normal_(std=0.02)
            for tokens in (1, 16, 128, 1024, 4096):
                hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
                ids = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=1)[1]
                weights = torch.rand(tokens, top_k, device="cuda")
                row = {"layer": name, "tokens": tokens}
                for mode in ("grouped", "loop"):
                    layer.mode = mode
                    call = functools.partial(layer, hidden, weights, ids)
                    row[f"{mode}_ms"] = round(cuda_ms(call), 3)
                row["speedup"] = round(row["loop_ms"] / row["grouped_ms"], 2)
                print(json.dumps(row), flush=True)


def build(directory: Path, tokenizer: Path) -> Path:
    if (directory / "config.json").exists():
        return directory
    from moe_mla import SCALED
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(DeepseekV3Config(**SCALED), dtype=torch.bfloat16)
    model.save_pretrained(directory)
    for file in tokenizer.iterdir():
        shutil.copy(file, directory / file.name)
    return directory


def decode(path: Path, batches: list[int], steps: int) -> None:
    from ember import LLM, SamplingParams
    from ember.models.moe import Experts

    llm = LLM(str(path), device="cuda", kv_cache_memory=1 << 30, enable_prefix_caching=False)
    layers = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, Experts)]
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for batch in batches:
        prompts = [[(97 * i + 13 * j) % 40000 + 100 for j in range(64)] for i in range(batch)]
        row, outs = {"model": "DeepSeek-V3 scaled (bf16)", "batch": batch}, {}
        for mode in ("grouped", "loop"):
            for layer in layers:
                layer.mode = mode
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            start = time.perf_counter()
            out = llm.generate(prompts, params)
            wall = time.perf_counter() - start
            outs[mode] = [o.outputs[0].token_ids for o in out]
            row[f"{mode}_tok_s"] = round(batch * steps / wall, 1)
        same = sum(
            next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
            for x, y in zip(outs["grouped"], outs["loop"], strict=True)
        )
        row["greedy_tokens_agreeing"] = f"{same}/{batch * steps}"
        print(json.dumps(row), flush=True)


def tier_bandwidth(num_blocks: int) -> None:
    from ember.kv.tiers import TieredStore

    # SmolLM2-135M: 30 layers x (K, V) x 16 tokens x 3 heads x 64, bf16: 368,640 B a block
    caches = [
        torch.randn(2, 2 * num_blocks, 16, 3, 64, device="cuda", dtype=torch.bfloat16)
        for _ in range(30)
    ]
    store = TieredStore(caches, "bench", 2 * num_blocks * 368640, None, 0)
    total = num_blocks * store.block_bytes
    pairs = [(i.to_bytes(8, "little"), i) for i in range(num_blocks)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    store.save(pairs)
    save_s = time.perf_counter() - start
    targets = [(h, num_blocks + i) for i, (h, _) in enumerate(pairs)]
    start = time.perf_counter()
    loaded = store.load(targets).future.result()
    load_s = time.perf_counter() - start
    assert loaded == total
    same = all(torch.equal(c[:, :num_blocks], c[:, num_blocks:]) for c in caches)
    flat = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    d2h = cuda_ms(lambda: pinned.copy_(flat, non_blocking=True), 5) / 1e3
    h2d = cuda_ms(lambda: flat.copy_(pinned, non_blocking=True), 5) / 1e3
    print(json.dumps({
        "tier": "host (pinned)", "blocks": num_blocks, "mb": round(total / 1e6),
        "save_gb_s": round(total / save_s / 1e9, 2), "load_gb_s": round(total / load_s / 1e9, 2),
        "loaded_equal_saved": same, "plain_d2h_gb_s": round(total / d2h / 1e9, 2),
        "plain_h2d_gb_s": round(total / h2d / 1e9, 2),
    }), flush=True)  # fmt: skip
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/ember-ds-gpu"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--only", choices=["layers", "tiers", "decode"], nargs="+",
                        default=["layers", "tiers", "decode"])  # fmt: skip
    args = parser.parse_args()
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}))
    if "layers" in args.only:
        layer_times()
    if "tiers" in args.only:
        for _ in range(3):  # the first warms the pinned allocator and the streams
            tier_bandwidth(args.blocks)
    if "decode" in args.only:
        decode(build(args.dir, args.tokenizer), args.batches, args.steps)


if __name__ == "__main__":
    main()
