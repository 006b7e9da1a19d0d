"""Where a speculating engine's time goes: proposing drafts vs the target's steps.

    python benchmarks/spec_step_split.py --methods none ngram eagle3 --rounds 2

One request at a time (greedy, prefix caching off), each method on an engine of its
own, in turn each round: output tokens per second, milliseconds per step in the target's
forward (`ModelRunner.execute`) and in the proposer, and drafts accepted. `eagle3` uses
`--eagle3-head`, or a head with random weights sized for the model (written once to
`--random-head-dir`): its drafts are then never accepted, so it measures what drafting
costs, which a trained head's acceptance must pay for.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ember import LLM, SamplingParams
from ember.loader.checkpoint import open_checkpoint
from ember.loader.default_models import resolve_model

QUESTION = [{"role": "user", "content": "Explain how a hash map works and when it performs badly."}]


def write_random_head(model: str, path: Path, draft_vocab: int = 32000) -> Path:
    """An EAGLE-3 head with random weights, shaped for `model`."""
    if (path / "config.json").exists():
        return path
    cfg = open_checkpoint(resolve_model(model)).hf_config
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads, inter = cfg.get("num_key_value_heads", heads), cfg["intermediate_size"]
    head_dim = hidden // heads
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    layer = {
        "input_layernorm.weight": torch.ones(hidden),
        "hidden_norm.weight": torch.ones(hidden),
        "post_attention_layernorm.weight": torch.ones(hidden),
        "self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "mlp.gate_proj.weight": rand(inter, hidden),
        "mlp.up_proj.weight": rand(inter, hidden),
        "mlp.down_proj.weight": rand(hidden, inter),
    }
    tensors = {f"midlayer.{k}": v for k, v in layer.items()}
    tensors.update(
        {
            "fc.weight": rand(hidden, 3 * hidden),
            "norm.weight": torch.ones(hidden),
            "lm_head.weight": rand(draft_vocab, hidden),
            "d2t": torch.zeros(draft_vocab, dtype=torch.long),
        }
    )
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors")
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "vocab_size": cfg["vocab_size"], "draft_vocab_size": draft_vocab,
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6), "rope_theta": cfg.get("rope_theta", 1e4),
        "max_position_embeddings": cfg.get("max_position_embeddings", 8192),
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return path


def timed(obj, name: str, totals: dict[str, float]) -> None:
    """Adds the seconds spent in obj.name to totals[name]."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start

    setattr(obj, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", nargs="+", default=["none", "ngram", "eagle3"])
    p.add_argument("--eagle3-head", default=None)
    p.add_argument("--random-head-dir", default="/tmp/ember-random-eagle3")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--adaptive", action="store_true", help="the adaptive number of drafts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    head = args.eagle3_head or str(write_random_head(args.model, Path(args.random_head_dir)))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engines, outputs = {}, {}
    for method in args.methods:
        options = {} if method == "none" else {"speculative_method": method}
        if method in ("eagle3", "draft"):
            options["speculative_model"] = head
        engines[method] = LLM(
            args.model, enable_prefix_caching=False, speculative_adaptive=args.adaptive,
            num_speculative_tokens=args.num_speculative_tokens, **options,
        )  # fmt: skip
        engines[method].chat([QUESTION], params)  # warm
    for r in range(args.rounds):
        order = args.methods[r % len(args.methods) :] + args.methods[: r % len(args.methods)]
        for method in order:
            llm = engines[method]
            core, totals = llm.engine.core, {}
            timed(core.runner, "execute", totals)
            if core.speculator is not None:
                timed(core.speculator.proposer, "propose", totals)
            steps, start = core.stats().num_steps, time.perf_counter()
            out = llm.chat([QUESTION], params)[0].outputs[0].token_ids
            seconds, steps = time.perf_counter() - start, core.stats().num_steps - steps
            del core.runner.execute  # the wrappers off again (instance attributes)
            if core.speculator is not None:
                del core.speculator.proposer.propose
            spec = core.stats().spec_decode or {}
            outputs.setdefault(method, out)
            print(
                f"round {r} {method:7s} {len(out) / seconds:6.1f} tok/s  {steps} steps  "
                f"target {1e3 * totals['execute'] / steps:5.2f} ms/step  "
                f"propose {1e3 * totals.get('propose', 0.0) / steps:5.2f} ms/step  "
                f"accepted {spec.get('acceptance_rate', 0.0):.2f}  "
                f"same as none: {out == outputs.get('none', out)}"
            )


if __name__ == "__main__":
    main()
