"""The offline API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from ember.config import EngineConfig
from ember.engine.llm_engine import LLMEngine
from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Runs an engine in this process for batch generation.

    `model` is a Hugging Face directory, a .gguf file, or an alias such as
    "smollm2-135m" (the default); `options` are EngineConfig fields.
    """

    def __init__(self, model: str | None = None, **options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **options))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops what the engine started (other ranks, KV endpoints, threads); also on
        leaving a `with LLM(...) as llm:` block."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        kv_retention: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in order. Bad input raises ValueError before
        anything runs. `kv_retention="session"`: the prompts' KV is kept as an agent
        session's in the tiers below the pool (evicted last, kept on disk for the TTL)."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        processed = [self.engine.process_prompt(p) for p in prompts]
        for prompt, param in zip(processed, params, strict=True):  # check all lengths first
            self.engine.input_processor.check(prompt, param)
        ids = [str(next(self._ids)) for _ in processed]
        for request_id, prompt, param in zip(ids, processed, params, strict=True):
            self.engine.add_request(request_id, prompt, param, cache_salt, kv_retention)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template")
        prompts = [
            list(
                tokenizer.apply_chat_template(
                    conv,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=True,
                    return_dict=True,
                )["input_ids"]
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, cache_salt=cache_salt)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return prompts


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"sampling_params: got {len(params)} for {count} prompts")
    return params
