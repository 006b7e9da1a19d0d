"""What int8 decode activations cost in output: greedy decoding of a few chat prompts, one
sequence at a time (so every decode step is a one-row step, the int8 path), with
`--decode-activations fp32` and then `int8`; per prompt, the position where the two first
part, and over the tokens before it, how far the chosen tokens' logprobs moved.

    python benchmarks/int8_quality.py FILE.gguf [--max-tokens 96]

Prints one JSON line: first_divergence (per prompt; max-tokens where they never part),
mean_lp_gap and max_lp_gap (|logprob int8 - logprob fp32| of the same tokens).
"""

from __future__ import annotations

import argparse
import json

from ember import LLM, SamplingParams

PROMPTS = [
    "Explain how a hash map handles collisions.",
    "Write a short poem about the sea.",
    "What is the capital of France, and why is it famous?",
    "List three uses of Python in data science.",
    "Describe the water cycle in simple terms.",
    "How do I reverse a linked list in C?",
]


def greedy(path: str, activations: str, max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """(tokens, their logprobs) per prompt, each prompt decoded alone."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1)
    out = []
    with LLM(
        path, decode_activations=activations, kv_cache_memory=256 << 20, max_model_len=1024
    ) as llm:
        tokenizer = llm.get_tokenizer()
        for prompt in PROMPTS:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
            completion = llm.generate([ids], params)[0].outputs[0]
            tokens = completion.token_ids
            out.append((tokens, [lp[t] for lp, t in zip(completion.logprobs, tokens, strict=True)]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    exact = greedy(args.model, "fp32", args.max_tokens)
    rounded = greedy(args.model, "int8", args.max_tokens)
    parts, gaps = [], []
    for (a, la), (b, lb) in zip(exact, rounded, strict=True):
        same = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        parts.append(same)
        gaps += [abs(x - y) for x, y in zip(la[:same], lb[:same], strict=True)]
    print(json.dumps({
        "model": args.model, "first_divergence": parts,
        "mean_lp_gap": round(sum(gaps) / max(len(gaps), 1), 4), "max_lp_gap": round(max(gaps, default=0), 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
