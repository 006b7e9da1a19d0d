"""What crosses the seam between a frontend and the engine core (msgspec structs, no pickle).

The frontend (API process, or `LLM` in one process) tokenizes and checks a request, then
sends one `EngineCoreRequest`; the core answers with `EngineCoreOutputs` after every
step that changed something. In a server these go over ZeroMQ as msgpack:

    API process                                   engine core process
      AddRequest / AbortRequests / Preparing /
      Shutdown                               -->    (PULL)
      (PULL)                                 <--    EngineReady once, then EngineCoreOutputs
                                                    (EngineFailed if loading failed)
"""

from __future__ import annotations

from typing import Any

import msgspec

from ember.kv.params import KVTransferParams, RemotePrefill
from ember.sampling_params import SamplingParams


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Of prompt tokens 1, 2, ... (token 0 has none): {token id: logprob} with the prompt's
    token first, then the top-N; and the rank of the prompt's token (1: the most likely)."""

    entries: list[dict[int, float]] = []
    ranks: list[int] = []

    def extend(self, more: PromptLogprobs) -> None:
        self.entries.extend(more.entries)
        self.ranks.extend(more.ranks)


class EngineCoreRequest(msgspec.Struct, tag="add"):
    """One user request, checked and tokenized; the core splits n > 1 into siblings."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context length by the frontend
    eos_token_ids: list[int]
    cache_salt: str | None = None
    session_id: str | None = None  # from x-session-affinity; logged, used by routers
    grammar: str | None = None  # an llguidance grammar every output must follow
    kv_transfer: KVTransferParams | None = None  # disaggregation: hold for, or load from
    kv_retention: str | None = None  # "session": the prompt's KV kept as a session's
    # a stream resumed from another worker (the router's migration): the tokens it had
    # output there, output here too before anything is sampled (their KV recomputed)
    resume_token_ids: list[int] | None = None
    # requests the frontend was still preparing (tokenizing) when it sent this one: an
    # idle core waits a moment for them, to take them in the same step (a hint only)
    num_preparing: int = 0


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]  # user request ids; the core aborts all of their sequences


class Preparing(msgspec.Struct, tag="preparing"):
    """Fewer requests than the last message said are on their way (one failed its
    checks): the core need not wait for them."""

    num_requests: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


EngineInput = EngineCoreRequest | AbortRequests | Preparing | Shutdown


class EngineCoreOutput(msgspec.Struct, array_like=True):
    """New tokens of one sequence (core request id, `{id}#{i}` when n > 1)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_cached_tokens: int
    queue_time: float | None = None  # seconds waiting before first scheduled; first output
    kv_transfer_params: RemotePrefill | None = None  # a finished prefill held for decode
    prompt_logprobs: PromptLogprobs | None = None  # with the first token, if asked for


class EngineStats(msgspec.Struct, frozen=True):
    num_waiting: int
    num_running: int
    num_queued_prefill_tokens: int  # prompt tokens not yet computed
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_sequences_received: int = 0  # of the requests taken so far (n each; admission control)
    num_prompt_tokens_computed: int = 0  # by the model (not found cached, not loaded)
    num_waiting_for_kv: int = 0  # requests whose prompt KV is on its way
    kv_loads_ok: int = 0
    kv_loads_failed: int = 0  # (then recomputed)
    kv_bytes_received: int = 0
    kv_load_seconds: float = 0.0  # all loads' durations, summed
    kv_held: int = 0  # finished prefills whose blocks wait for a decode worker
    kv_holds_expired: int = 0  # never fetched within kv_hold_timeout
    kv_bytes_sent: int = 0
    # the tiers below the pool, when there are any: tier -> its counters (ember.kv.tiers)
    kv_tiers: dict[str, dict[str, int | float]] | None = None
    num_steps: int = 0  # model steps since start
    step_seconds: float = 0.0  # their measured durations, summed
    step_predicted_seconds: float = 0.0  # the step cost model's predictions of them, summed
    step_error_seconds: float = 0.0  # |measured - predicted|, summed
    num_capped_steps: int = 0  # steps whose prefill chunk the step budget (max_step_ms) shrank
    num_sliced_steps: int = 0  # prompt steps run a slice of layers at a time (target_itl_ms)
    last_prefill_cap: int = 0  # the prefill tokens it allowed, the last time it did
    target_itl_ms: float = 0.0  # the ITL target prompts are sliced for now (0: off)
    # MoE models: (layer, tokens routed to each of its experts since start) per MoE layer;
    # sent at most once a second and when the engine goes idle (None in between)
    expert_tokens: list[tuple[int, list[int]]] | None = None
    # speculative decoding, when on: SpecStats.as_dict() (drafts, accepted, per position)
    spec_decode: dict[str, Any] | None = None
    kv_block_bytes: int = 0  # one block over every layer (what a transfer moves a block)


class RequestError(msgspec.Struct):
    request_id: str
    message: str  # why the core refused the request (e.g. a grammar it cannot compile)


class EngineCoreOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: EngineStats
    errors: list[RequestError] = []


class EngineReady(msgspec.Struct, tag="ready"):
    max_model_len: int
    num_kv_blocks: int
    startup: list[tuple[str, float, float]] = []  # the core's start-up phases (`ember.startup`)


class EngineFailed(msgspec.Struct, tag="failed"):
    message: str


EngineOutput = EngineCoreOutputs | EngineReady | EngineFailed
