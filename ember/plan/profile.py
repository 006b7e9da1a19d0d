"""One worker's speed, measured over HTTP (`ember plan profile`), and the cost model fitted
to it (`WorkerProfile`).

Two sweeps against an idle worker, through `/v1/completions` with token-id prompts (so
every prompt has exactly the tokens asked for, and random ids keep the prefix cache out):
- prefill: lone prompts of each length in `lengths`, `max_tokens` 1, timed to the answer
  (TTFT with the HTTP round trip), `repeats` each, the median kept;
- decode: `batch` fresh prompts of `context` tokens, each sent once for one token (so
  their KV is in the prefix cache), then streamed at once for `decode_tokens` new ones;
  the gaps between streamed tokens while every stream is decoding (from the last
  stream's first token to the first stream's last), the median kept.

Fitted by least squares with coefficients >= 0:
    prefill_ms(n, c) = base + per_token * n + per_kpair * n * (c + n / 2) / 1000
    decode_ms(B, c)  = base + per_row * B + per_krow * B * c / 1000
(n new tokens after c computed ones; B sequences of c tokens of context each). The same
shapes the engine's own step cost model uses (ember.engine.step_cost).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ember import envs
from ember.config import EngineConfig
from ember.plan import DECODE_BATCHES, DECODE_CONTEXTS, PREFILL_LENGTHS

# token ids of the probes' prompts: in every vocabulary of 512 tokens or more, past the
# few special ones at the start
PROBE_IDS = range(3, 500)


def nonneg_lstsq(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a coefficient that comes out negative is
    held at 0 and the rest fitted again, until none does."""
    free = np.ones(features.shape[1], dtype=bool)
    coef = np.zeros(features.shape[1])
    while free.any():
        fitted, *_ = np.linalg.lstsq(features[:, free], target, rcond=None)
        if (fitted >= 0).all():
            coef[:] = 0
            coef[free] = fitted
            return coef
        index = np.flatnonzero(free)[np.argmin(fitted)]
        free[index] = False
    return coef


def pairs(new: float, context: float) -> float:
    """Thousands of (query, key) pairs a chunk of `new` tokens after `context` attends."""
    return new * (context + new / 2) / 1000


ENGINE = EngineConfig()  # a worker's defaults, for profiles that do not say otherwise


@dataclass
class WorkerProfile:
    model: str
    # the worker's host: its CPU (and vector units) or GPU where `ember plan profile`
    # started the worker itself; what `--machine` says of a worker at --url
    machine: str
    prefill: list[list[float]]  # [new tokens, context tokens, ms] of lone prompts
    decode: list[list[float]]  # [batch, context tokens, ms per token]
    kv_bytes_per_token: int = 0  # what a prefill worker hands over per prompt token
    max_num_batched_tokens: int = ENGINE.max_num_batched_tokens  # the worker's prefill chunk
    max_step_ms: float = ENGINE.max_step_ms  # its step budget while decodes run (0: off)
    # its ITL target when profiled (0: off), and whether that was auto (the engine's own
    # share of its step costs) rather than set
    target_itl_ms: float = 0.0
    target_itl_auto: bool = False
    source: str = ""
    coefficients: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.prefill) < 3 or len(self.decode) < 3:
            raise ValueError("a worker profile needs 3 or more prefill and decode points")
        p = np.array(self.prefill, dtype=float)
        d = np.array(self.decode, dtype=float)
        prefill_x = np.stack([np.ones(len(p)), p[:, 0], pairs(p[:, 0], p[:, 1])], axis=1)
        decode_x = np.stack([np.ones(len(d)), d[:, 0], d[:, 0] * d[:, 1] / 1000], axis=1)
        self.coefficients = {
            "prefill": nonneg_lstsq(prefill_x, p[:, 2]).round(6).tolist(),
            "decode": nonneg_lstsq(decode_x, d[:, 2]).round(6).tolist(),
        }

    def prefill_ms(self, new: float, context: float = 0.0) -> float:
        """A lone prompt's prefill: `new` tokens after `context` computed (cached) ones."""
        base, per_token, per_kpair = self.coefficients["prefill"]
        return base + per_token * new + per_kpair * pairs(new, context)

    def prefill_work_ms(self, new: float, context: float = 0.0) -> float:
        """The same without the fixed part (what the prompt adds to steps that run anyway)."""
        return self.prefill_ms(new, context) - self.coefficients["prefill"][0]

    def decode_ms(self, batch: float, context: float) -> float:
        """One decode step of `batch` sequences of `context` tokens each."""
        base, per_row, per_krow = self.coefficients["decode"]
        return base + per_row * batch + per_krow * batch * context / 1000

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def load(cls, path: str | Path) -> WorkerProfile:
        data = json.loads(Path(path).read_text())
        data.pop("coefficients", None)  # fitted again from the points
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"{path} is not an ember plan profile: {exc}") from None


def machine() -> str:
    """This host's CPU and its vector units, or its GPU."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(isa) or 'no AVX2'}), {len(os.sched_getaffinity(0))} cores"


class Prober:
    """Sends the probes to a worker at `url` (an OpenAI-compatible ember worker)."""

    def __init__(self, url: str, model: str | None, api_key: str | None, seed: int = 0):
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=600)
        self.model = model
        self.rng = random.Random(seed)

    async def start(self) -> None:
        if self.model is None:
            reply = await self.client.get("/v1/models")
            reply.raise_for_status()
            self.model = reply.json()["data"][0]["id"]

    def prompt(self, length: int) -> list[int]:
        return [self.rng.choice(PROBE_IDS) for _ in range(length)]

    async def lone_prompt_ms(self, length: int) -> float:
        body = {"model": self.model, "prompt": self.prompt(length), "max_tokens": 1,
                "temperature": 0.0}  # fmt: skip
        start = time.perf_counter()
        reply = await self.client.post("/v1/completions", json=body)
        elapsed = (time.perf_counter() - start) * 1e3
        _check(reply)
        return elapsed

    async def decode_gap_ms(self, batch: int, context: int, new_tokens: int) -> float:
        """The median gap between tokens while all `batch` streams decode. Their prompts
        are sent once first (one token each), so that the streams find them in the
        prefix cache and start decoding together rather than one prefill at a time."""
        prompts = [self.prompt(context) for _ in range(batch)]
        for reply in await asyncio.gather(*(self._complete(p) for p in prompts)):
            _check(reply)
        streams = await asyncio.gather(
            *(self._stream(p, new_tokens) for p in prompts)
        )  # each: the times its tokens came
        if not all(streams):
            raise ValueError(
                f"decode probe: a stream of {batch} gave no token; raise --decode-tokens"
            )
        start, end = max(t[0] for t in streams), min(t[-1] for t in streams)
        gaps = [
            (b - a) * 1e3
            for times in streams
            for a, b in zip(times, times[1:], strict=False)
            if a >= start and b <= end
        ]
        if not gaps:
            raise ValueError(
                f"decode probe: no two tokens came while all {batch} streams of {context} "
                f"tokens were decoding; raise --decode-tokens"
            )
        return statistics.median(gaps)

    async def _complete(self, prompt: list[int]):
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        return await self.client.post("/v1/completions", json=body)

    async def _stream(self, prompt: list[int], new_tokens: int) -> list[float]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": new_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
        times = []
        async with self.client.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                await reply.aread()
                _check(reply)
            async for line in reply.aiter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    event = json.loads(line[5:])
                    choice = (event.get("choices") or [{}])[0]
                    # a token (its text may be held back), not a bare finish
                    if choice and (choice.get("text") or not choice.get("finish_reason")):
                        times.append(time.perf_counter())
        return times

    async def worker_load(self) -> dict:
        reply = await self.client.get("/load")
        return reply.json() if reply.status_code == 200 else {}

    async def close(self) -> None:
        await self.client.aclose()


def _check(reply) -> None:
    if reply.status_code != 200:
        raise ValueError(f"the worker answered {reply.status_code}: {reply.text[:300]}")


async def measure(
    url: str,
    model: str | None = None,
    api_key: str | None = None,
    lengths=PREFILL_LENGTHS,
    batches=DECODE_BATCHES,
    contexts=DECODE_CONTEXTS,
    decode_tokens: int = 48,
    repeats: int = 3,
    max_context_tokens: int = 16384,
    host: str | None = None,
    progress: bool = True,
) -> WorkerProfile:
    """The profile of the idle worker at `url`. Decode batches whose prompts together pass
    `max_context_tokens` are left out (their prefill alone would take most of the run)."""
    from tqdm import tqdm

    prober = Prober(url, model, api_key)
    try:
        await prober.start()
        await prober.lone_prompt_ms(16)  # warm-up
        shapes = [(b, c) for c in contexts for b in batches if b * c <= max_context_tokens]
        bar = tqdm(total=len(lengths) * repeats + len(shapes), desc="profiling",
                   unit="probe", disable=not progress)  # fmt: skip
        prefill = []
        for length in lengths:
            times = []
            for _ in range(repeats):
                times.append(await prober.lone_prompt_ms(length))
                bar.update()
            prefill.append([length, 0, round(statistics.median(times), 3)])
        decode = []
        for batch, context in shapes:
            gap = await prober.decode_gap_ms(batch, context, decode_tokens)
            decode.append([batch, context + decode_tokens / 2, round(gap, 3)])
            bar.update()
        bar.close()
        load = await prober.worker_load()
    finally:
        await prober.close()
    limits = load.get("step_limits") or {}
    return WorkerProfile(
        model=prober.model,
        machine=host or f"not given (a worker at {url})",
        prefill=prefill,
        decode=decode,
        kv_bytes_per_token=int(load.get("kv_bytes_per_token") or 0),
        max_num_batched_tokens=int(
            limits.get("max_num_batched_tokens", ENGINE.max_num_batched_tokens)
        ),
        max_step_ms=float(limits.get("max_step_ms", ENGINE.max_step_ms)),
        target_itl_ms=float(limits.get("target_itl_ms") or 0.0),
        target_itl_auto=bool(limits.get("target_itl_auto", False)),
        source=url,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def profile_here(
    model: str | None, serve_args: list[str], cores: int | None, **options
) -> WorkerProfile:
    """Starts `ember serve MODEL SERVE_ARGS` on this machine (on its first `cores` cores,
    if given, as `ember up --pin` gives each worker a share), profiles it, stops it."""
    from ember.router.up import Cluster

    allowed = sorted(os.sched_getaffinity(0))
    if cores is not None and not 1 <= cores <= len(allowed):
        raise ValueError(f"--cores must be between 1 and {len(allowed)}, got {cores}")
    use = allowed[:cores] if cores else allowed
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = ["serve", *([model] if model else []), "--host", "127.0.0.1", "--port", str(port),
               *serve_args]  # fmt: skip
    worker = Cluster()
    try:
        env = dict(os.environ, OMP_NUM_THREADS=str(len(use)))
        worker.start("worker", command, env, set(use) if cores else None)
        try:
            worker.wait_healthy([url])
        except RuntimeError as exc:
            raise ValueError(f"the worker to profile did not come up: {exc}") from None
        host = f"{machine().rsplit(',', 1)[0]}, {len(use)} cores"
        # the worker asks for $EMBER_API_KEY where it is set, as `ember serve` does
        return asyncio.run(measure(url, api_key=envs.api_key(), host=host, **options))
    finally:
        worker.stop()
