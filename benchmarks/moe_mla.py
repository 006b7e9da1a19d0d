"""MoE and MLA: what the latent cache saves, and a random-init DeepSeek-V3 run.

    python benchmarks/moe_mla.py [--dir /tmp/ember-ds-bench] [--batches 1 4 16] [--steps 24]
    python benchmarks/moe_mla.py --gguf Q4_0 [--batches 1 4 16]

1. KV bytes per token and layer in bf16, and how many 8k-token sequences fit in 64 GiB,
   for DeepSeek-V3's and Kimi K2's shapes: the latent layout against caching each head's
   keys and values (what the model would need without MLA) and against a GQA cache of
   8 KV heads of the same head sizes.
2. A random-init DeepseekV3ForCausalLM with DeepSeek's ratios scaled down to ~1 GB of
   fp32 (written once under --dir): the peak resident memory of a process that loads it
   against the checkpoint's size, decode tokens/s at each batch size (64-token prompts),
   the share of a decode step spent routing, in the experts, in attention and elsewhere,
   and transformers' decode speed on the same checkpoint for reference.
3. With --gguf TYPE: the same model written as a deepseek2 GGUF file in TYPE (Q4_0,
   Q8_0, ...) the way llama.cpp's converter lays it out (tests/gguf_convert.py), and
   ember's decode speed on it reading the file's blocks (experts included) against
   reading the fp32 weights (`gguf_blocks=False`): what the blocks save when decode is
   memory-bound.
Prints a JSON line per measurement.
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

GIB = 1 << 30
SHAPES = {  # name: (layers, heads, kv_lora_rank, qk_rope, qk_nope, v_head_dim)
    "DeepSeek-V3": (61, 128, 512, 64, 128, 128),
    "Kimi K2": (61, 64, 512, 64, 128, 128),
}
# DeepSeek-V3's ratios at 1/7 of its width: MLA, 64 experts (8 groups of which a token
# takes 4, 8 experts a token), a shared expert, a dense first layer, YaRN
SCALED = dict(
    vocab_size=49152, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=256,
    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=1,
    n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
    first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=128, q_lora_rank=384,
    qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=4096,
    tie_word_embeddings=False, initializer_range=0.02,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 1024, "mscale": 1.0,
                     "mscale_all_dim": 1.0},
)  # fmt: skip


def kv_sizes() -> None:
    for name, (layers, heads, lora, rope, nope, v) in SHAPES.items():
        per_token = {
            "mla_latent": layers * (lora + rope) * 2,
            "every_head_kv": layers * heads * (nope + rope + v) * 2,
            "gqa_8_kv_heads": layers * 8 * (nope + rope + v) * 2,
        }
        fits = {k: int(64 * GIB // (b * 8192)) for k, b in per_token.items()}
        print(
            json.dumps({"model": name, "kv_bytes_per_token": per_token, "seqs_8k_in_64GiB": fits})
        )


def build(directory: Path) -> Path:
    if (directory / "config.json").exists():
        return directory
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from ember import LLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(DeepseekV3Config(**SCALED), dtype=torch.float32)
    model.save_pretrained(directory)
    LLM(None).get_tokenizer().save_pretrained(directory)  # the default model's (49152)
    return directory


def peak_load_rss(path: Path) -> None:
    """A fresh process loads the model; its peak RSS against the checkpoint's bytes."""
    code = (
        "import resource, torch\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "from ember import LLM\n"
        f"LLM({str(path)!r}, kv_cache_memory=1 << 26)\n"
        "print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    base_kb, peak_kb = map(int, out.stdout.split()[-2:])
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(json.dumps({
        "checkpoint_mb": round(size / 2**20), "peak_rss_mb": round(peak_kb / 1024),
        "after_imports_mb": round(base_kb / 1024),
        "peak_over_checkpoint": round((peak_kb - base_kb) * 1024 / size, 2),
    }))  # fmt: skip


class Timers:
    """Seconds inside the router, the experts and attention, by patching their forwards."""

    def __init__(self) -> None:
        from ember.engine.mla import MLABackend
        from ember.models.moe import Experts, TopKRouter

        self.seconds = collections.Counter()
        for name, cls in (("routing", TopKRouter), ("experts", Experts), ("attention", MLABackend)):
            self._wrap(name, cls)

    def _wrap(self, name: str, cls) -> None:
        forward = cls.forward

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = forward(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - start
            return out

        cls.forward = timed


def write_gguf_file(path: Path, qtype_name: str) -> Path:
    target = path / f"model-{qtype_name}.gguf"
    if target.exists():
        return target
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gguf_convert import QT, write_gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    write_gguf(model, "deepseek_v3", target, qtype=QT[qtype_name], tokenizer_dir=None)
    return target


def ember_decode(path: Path, batches: list[int], steps: int, **options) -> None:
    from ember import LLM, SamplingParams

    llm = LLM(str(path), kv_cache_memory=1 << 30, enable_prefix_caching=False, **options)
    timers = Timers()
    engine = llm.engine
    for batch in batches:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
        for i in range(batch):
            prompt = [(97 * i + 13 * j) % 40000 + 100 for j in range(64)]
            engine.add_request(f"b{batch}-{i}", engine.process_prompt(prompt), params)
        engine.step()  # the prompts
        engine.step()  # a first decode step (warm-up)
        timers.seconds.clear()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
        while engine.has_unfinished():
            engine.step()
        shares = {k: round(v / wall, 3) for k, v in timers.seconds.items()}
        shares["other"] = round(1 - sum(shares.values()), 3)
        print(json.dumps({
            "engine": "ember", "model": path.name, **options, "batch": batch,
            "decode_tok_s": round(batch * steps / wall, 1),
            "step_ms": round(wall / steps * 1e3, 1), "share": shares,
        }))  # fmt: skip


def transformers_decode(path: Path, batches: list[int], steps: int) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for batch in batches:
        ids = torch.tensor(
            [[(97 * i + 13 * j) % 40000 + 100 for j in range(64)] for i in range(batch)]
        )

        def run(new: int, ids=ids) -> float:
            start = time.perf_counter()
            model.generate(
                ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
            return time.perf_counter() - start

        run(2)  # warm-up
        wall = run(steps + 1) - run(1)  # the decode steps alone
        print(json.dumps({
            "engine": "transformers", "batch": batch, "decode_tok_s": round(batch * steps / wall, 1),
            "step_ms": round(wall / steps * 1e3, 1),
        }))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/tmp/ember-ds-bench")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--gguf", metavar="TYPE", help="decode a GGUF file of it in TYPE")
    args = parser.parse_args()
    path = build(Path(args.dir))
    if args.gguf:
        target = write_gguf_file(path, args.gguf)
        print(json.dumps({"gguf_mb": round(target.stat().st_size / 2**20)}))
        for blocks in (True, False, True, False):  # in turn: this box's speed drifts
            ember_decode(target, args.batches, args.steps, gguf_blocks=blocks)
        return
    kv_sizes()
    peak_load_rss(path)
    ember_decode(path, args.batches, args.steps)
    if not args.skip_transformers:
        transformers_decode(path, args.batches, args.steps)
    print(json.dumps({"cpu_threads": torch.get_num_threads(), "maxrss_mb": round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))  # fmt: skip


if __name__ == "__main__":
    main()
