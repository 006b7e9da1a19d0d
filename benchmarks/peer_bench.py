"""Streaming load test for any OpenAI-compatible server (vLLM, llama.cpp, ember serve).

Run (stdlib HTTP; transformers only to build the prompts), e.g. workload A against vLLM:

    .venv/bin/python benchmarks/peer_bench.py --url http://127.0.0.1:8101 \\
        --model /work/peers/smollm2-hf --concurrency 4 --num-requests 4 \\
        --prompt-tokens 286 --max-tokens 64 --repeats 3 --out /tmp/vllm_a.json

llama-cpp-python's server has no ignore_eos and a default repeat_penalty of 1.1, so add
`--extra '{"logit_bias": {"2": -100}, "repeat_penalty": 1.0}'` there.

Each request is a streaming POST /v1/completions with temperature 0, ignore_eos, max_tokens
and --extra. Prompts are distinct random plain words, exactly --prompt-tokens tokens under
the SmolLM2 tokenizer (--tokenizer), sent as token ids when the server accepts them (probed
once; --prompt-mode forces ids or text). Per request: TTFT (send -> first chunk with text),
inter-token latencies (gaps between text chunks), end-to-end. Per run: output tok/s =
output tokens (usage.completion_tokens, else text chunks) / wall time of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from urllib.parse import urlsplit


def percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def build_prompts(
    tokenizer_path: str, n_tokens: int, count: int, seed: int
) -> list[tuple[str, list[int]]]:
    """`count` distinct texts of exactly `n_tokens` tokens (one plain word per token), with ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    vocab = tok.get_vocab()
    words = sorted(t[1:] for t in vocab if re.fullmatch(r"Ġ[a-z]{3,8}", t) and t[1:] in vocab)
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        text = " ".join(rng.choice(words) for _ in range(n_tokens))
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) != n_tokens:
            raise RuntimeError(f"prompt has {len(ids)} tokens, wanted {n_tokens}")
        prompts.append((text, ids))
    return prompts


async def post_stream(url: str, body: dict):
    """POST `body` as JSON; yields (time, line) for each line of the response body."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
    data = json.dumps(body).encode()
    head = (
        f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()
    try:
        status_line = await reader.readline()
        status = int(status_line.split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {(await reader.read()).decode()[:500]}")
        chunked = "chunked" in headers.get("transfer-encoding", "")
        buf = b""
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    break
                piece = (await reader.readexactly(size + 2))[:-2]
            else:
                piece = await reader.read(65536)
                if not piece:
                    break
            now = time.perf_counter()
            buf += piece
            *lines, buf = buf.split(b"\n")
            for line in lines:
                yield now, line.decode().rstrip("\r")
        if buf:
            yield time.perf_counter(), buf.decode().rstrip("\r")
    finally:
        writer.close()


async def one_request(args, prompt) -> dict:
    body = {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(json.loads(args.extra))
    start = time.perf_counter()
    times, usage, text = [], None, []
    async for now, line in post_stream(args.url.rstrip("/") + "/v1/completions", body):
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        event = json.loads(line[5:])
        usage = event.get("usage") or usage
        chunk = "".join(c.get("text") or "" for c in event.get("choices") or [])
        if chunk:
            times.append(now)
            text.append(chunk)
    end = time.perf_counter()
    tokens = (usage or {}).get("completion_tokens") or len(times)
    return {
        "ttft": times[0] - start if times else float("nan"),
        "itl": [b - a for a, b in zip(times, times[1:], strict=False)],
        "e2e": end - start,
        "output_tokens": tokens,
        "text_chunks": len(times),
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "text": "".join(text),
    }


async def run_batch(args, prompts) -> tuple[float, list[dict]]:
    sem = asyncio.Semaphore(args.concurrency)

    async def limited(p):
        async with sem:
            return await one_request(args, p)

    start = time.perf_counter()
    results = await asyncio.gather(*(limited(p) for p in prompts))
    return time.perf_counter() - start, results


async def accepts_token_ids(args, ids: list[int]) -> bool:
    try:
        probe = argparse.Namespace(**{**vars(args), "max_tokens": 1})
        await one_request(probe, ids)
        return True
    except (RuntimeError, ValueError, KeyError, json.JSONDecodeError):
        return False


def stats(values: list[float]) -> dict:
    mean = statistics.fmean(values) if values else float("nan")
    return {"mean": mean, "p50": percentile(values, 50), "p90": percentile(values, 90)}


def summarize(wall: float, results: list[dict]) -> dict:
    out = sum(r["output_tokens"] for r in results)
    return {
        "wall_s": wall,
        "output_tokens": out,
        "output_tok_s": out / wall,
        "ttft_ms": stats([r["ttft"] * 1e3 for r in results]),
        "itl_ms": stats([x * 1e3 for r in results for x in r["itl"]]),
        "e2e_ms_mean": statistics.fmean(r["e2e"] * 1e3 for r in results),
        "prompt_tokens": sorted({r["prompt_tokens"] for r in results}, key=str),
    }


def print_table(rows: list[tuple[str, dict]]) -> None:
    print("run        tok/s  TTFT mean   p50    p90 | ITL mean   p50    p90  (ms)")
    for name, s in rows:
        t, i = s["ttft_ms"], s["itl_ms"]
        print(
            f"{name:<8} {s['output_tok_s']:7.2f} {t['mean']:9.1f} {t['p50']:6.1f} {t['p90']:6.1f} |"
            f" {i['mean']:8.1f} {i['p50']:6.1f} {i['p90']:6.1f}"
        )


async def main_async(args) -> dict:
    total = args.warmup + args.repeats * args.num_requests
    prompts = build_prompts(args.tokenizer, args.prompt_tokens, total + 1, args.seed)
    mode = args.prompt_mode
    if mode == "auto":
        mode = "ids" if await accepts_token_ids(args, prompts[-1][1]) else "text"
    pick = 1 if mode == "ids" else 0
    print(f"prompt mode: {mode}")
    for p in prompts[: args.warmup]:
        await one_request(args, p[pick])
    runs = []
    for k in range(args.repeats):
        lo = args.warmup + k * args.num_requests
        wall, results = await run_batch(
            args, [p[pick] for p in prompts[lo : lo + args.num_requests]]
        )
        runs.append({"summary": summarize(wall, results), "requests": results})
    rows = [(f"run{k + 1}", r["summary"]) for k, r in enumerate(runs)]
    med = {
        "output_tok_s": statistics.median(r["summary"]["output_tok_s"] for r in runs),
        **{
            key: {
                q: statistics.median(r["summary"][key][q] for r in runs)
                for q in ("mean", "p50", "p90")
            }
            for key in ("ttft_ms", "itl_ms")
        },
    }
    print_table([*rows, ("median", med)])
    return {
        "config": vars(args),
        "prompt_mode": mode,
        "runs": runs,
        "median": med,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8101")
    ap.add_argument("--model", required=True)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--num-requests", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=286)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of --num-requests each")
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests before the runs")
    ap.add_argument("--prompt-mode", choices=["auto", "ids", "text"], default="auto")
    ap.add_argument("--tokenizer", default="/work/peers/smollm2-hf")
    ap.add_argument(
        "--extra", default="{}", help='JSON merged into each body: {"repeat_penalty": 1}'
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    result = asyncio.run(main_async(args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
