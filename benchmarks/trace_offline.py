"""The conversation-trace workload replayed in process, step by step: where a serving
engine's time goes, without the HTTP server or the client beside it.

    python benchmarks/trace_offline.py --precision bf16 --max-step-ms 0 --prefault --kernel-times

Sends the first 40 requests of the Mooncake conversation trace (16-token blocks, as
`ember bench serve --workload trace` builds them; at most 12 output tokens each, about
what the model answers there), 8 at a time like the client's --max-concurrency 8, and
prints the wall time, the step count and the requests' time to first token and gaps
between tokens (as the engine returned them: no HTTP, no detokenizing); --steps prints
every step's time and shape, --kernel-times the time in each of ember's C++ kernels (and
the page faults they took), --prefault first does the idle work a server does before
its first request (KV pages, matmul timings, calibration). --target-itl-ms as `ember
serve`'s.
"""

from __future__ import annotations

import argparse
import collections
import resource
import time
import types
from pathlib import Path

import torch

import ember.engine.calibration as calibration
import ember.models.layers as layers
from ember.bench.workloads import WordSource, trace_workload
from ember.engine.kernels import cpu_kernels
from ember.llm import LLM
from ember.sampling_params import SamplingParams

TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake-conversation_trace.jsonl"


class TimedKernels:
    """ember's kernel module with every call timed (seconds, calls, page faults by name)."""

    def __init__(self, module) -> None:
        self._module = module
        self.seconds, self.calls, self.faults = (collections.Counter() for _ in range(3))

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        if not callable(fn):
            return fn

        def timed(*args):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            out = fn(*args)
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1
            self.faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            return out

        return timed


def time_kernels(engine) -> TimedKernels:
    timed = TimedKernels(cpu_kernels())

    def kernels_for(x):
        return timed if x.device.type == "cpu" and x.dtype == torch.float32 else None

    layers.cpu_kernels_for = kernels_for
    model = engine.core.runner.model
    for module in model.modules():
        if getattr(module, "block_gemm", None) is not None:
            module.block_gemm = timed.block_gemm
        if getattr(module, "small_gemm", None) is not None:
            module.small_gemm = timed.small_gemm
        if getattr(getattr(module, "backend", None), "kernels", None) is not None:
            module.backend.kernels = timed
    if model.model.fused_decode is not None:
        model.model.fused_decode.kernels = timed
    return timed


def replay(engine, prompts, params, concurrency: int):
    """Runs `prompts` through the engine `concurrency` at a time, step by step, as a
    serving client keeping that many requests open would: (wall seconds, each step's
    seconds, each step's shape (None for an empty step), the step cost model's prediction
    of each, each request's time to first token and its gaps between tokens, seconds)."""
    scheduler, shapes, step_s = engine.core.scheduler, [], []
    predicted = []
    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        shapes.append(None if out.empty else out.shape())
        # what the step cost model predicted for it, before it ran
        predicted.append(None if out.empty else scheduler.cost_model.predict_ms(shapes[-1]))
        return out

    scheduler.schedule = recording_schedule
    pending, running = list(range(len(prompts))), set()
    sent, last, seen, ttft, itl = {}, {}, {}, [], []
    start = time.perf_counter()
    while pending or running:
        while pending and len(running) < concurrency:
            i = pending.pop(0)
            engine.add_request(f"r{i}", engine.process_prompt(list(prompts[i])), params)
            running.add(f"r{i}")
            sent[f"r{i}"] = time.perf_counter()
        t = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        step_s.append(now - t)
        for o in outputs:  # (their token lists so far)
            n = len(o.outputs[0].token_ids)
            if n == seen.get(o.request_id, 0):
                continue
            if o.request_id in last:
                itl.append(now - last[o.request_id])
            else:
                ttft.append(now - sent[o.request_id])
            last[o.request_id], seen[o.request_id] = now, n
        running -= {o.request_id for o in outputs if o.finished}
    scheduler.schedule = schedule
    return time.perf_counter() - start, step_s, shapes, predicted, ttft, itl


def percentiles(seconds: list[float]) -> str:
    """Mean, p50 and p90 of `seconds`, in ms."""
    ms = sorted(s * 1e3 for s in seconds)
    at = lambda q: ms[min(int(q * len(ms)), len(ms) - 1)]  # noqa: E731
    return f"mean {sum(ms) / len(ms):.0f}, p50 {at(0.5):.0f}, p90 {at(0.9):.0f} ms"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", default="bf16", choices=["ieee", "bf16", "int8", "auto"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-step-ms", type=float, default=100.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--target-itl-ms", type=float, default=0.0)
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--prefault", action="store_true")
    p.add_argument("--kernel-times", action="store_true")
    p.add_argument("--steps", action="store_true")
    p.add_argument(
        "--short-calibration",
        action="store_true",
        help="calibrate without the chunks after a long context (the pairs' cost a prior)",
    )
    p.add_argument(
        "--predictions",
        action="store_true",
        help="how far the step cost model's predictions of the steps with prompts were off",
    )
    p.add_argument(
        "--fp32-attention",
        action="store_true",
        help="bf16 prefill chunks attend in float32 even where the CPU has a bf16 dot product",
    )
    args = p.parse_args()
    if args.short_calibration:
        calibration.LONG_CONTEXT_MIN = 1 << 30
    llm = LLM(
        None,
        matmul_precision=args.precision,
        kv_cache_memory=1 << 30,
        max_model_len=4096,
        max_step_ms=args.max_step_ms,
        max_num_batched_tokens=args.max_num_batched_tokens,
        target_itl_ms=args.target_itl_ms,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine, tokenizer = llm.engine, llm.get_tokenizer()
    if args.fp32_attention:
        engine.core.runner.model.model.layers[0].self_attn.backend.bf16_dot = False
    workload = types.SimpleNamespace(
        trace=args.trace, trace_start=0, num_requests=40, trace_block_tokens=16,
        seed=args.seed, trace_output_scale=1.0, time_scale=0,
    )  # fmt: skip
    sessions = trace_workload(WordSource(tokenizer, 0), workload)
    prompts = [
        tokenizer.apply_chat_template(
            s.turns[0].messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for s in sessions
    ]
    if args.prefault:  # the pool's pages, then the step cost calibration, as when idle
        while engine.core.has_idle_work():
            engine.core.idle_work()
    llm.generate([list(range(100, 400))], SamplingParams(max_tokens=4))  # warm-up
    timed = time_kernels(engine) if args.kernel_times else None
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    wall, step_s, shapes, predicted_ms, ttft, itl = replay(engine, prompts, params, 8)
    print(
        f"{args.precision}, --max-step-ms {args.max_step_ms:g}, --target-itl-ms "
        f"{args.target_itl_ms:g}: {wall:.2f} s, {len(step_s)} steps, "
        f"{sum(map(len, prompts))} prompt tokens, {12 * len(prompts)} output tokens; "
        f"TTFT {percentiles(ttft)}; ITL {percentiles(itl)}"
    )
    if args.steps:
        for seconds, shape in zip(step_s, shapes, strict=False):
            print(f"  {seconds * 1e3:7.1f} ms  {shape}")
    if args.predictions:
        steps = zip(step_s, shapes, predicted_ms, strict=False)
        errors = [
            (seconds * 1e3 - predicted, seconds * 1e3)
            for seconds, shape, predicted in steps
            if shape is not None and shape.num_prefill_tokens
        ]
        mean = sum(abs(e) for e, _ in errors) / max(len(errors), 1)
        over = sum(ms > 1.02 * args.max_step_ms for _, ms in errors) if args.max_step_ms else 0
        print(
            f"  steps with prompts: {len(errors)}, predictions off by {mean:.1f} ms on "
            f"average, {over} steps more than 2% past the budget"
        )
    if timed is not None:
        for name, seconds in timed.seconds.most_common():
            print(
                f"  {name}: {seconds:.3f} s, {timed.calls[name]} calls, "
                f"{timed.faults[name]} page faults"
            )


if __name__ == "__main__":
    main()
