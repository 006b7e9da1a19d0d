"""The frontend and the engine core in one process: what the offline `LLM` drives
(`AsyncLLM`, for servers, runs the same frontend with the core in its own process).

`add_request` checks and tokenizes, `step` runs one engine step and returns the
RequestOutputs it changed, `abort_request` ends a request at any moment.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from ember.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.messages import EngineStats
from ember.engine.output_processor import OutputProcessor
from ember.engine.processor import InputProcessor, ProcessedPrompt
from ember.loader.checkpoint import open_checkpoint
from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams

logger = logging.getLogger("ember.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from ember.loader.default_models import resolve_model

        self.checkpoint = open_checkpoint(resolve_model(config.model))
        # the tokenizer (mostly Python) loads while the weights (mostly torch) do
        with ThreadPoolExecutor(1, thread_name_prefix="ember-tokenizer") as pool:
            tokenizer = pool.submit(self.checkpoint.tokenizer)
            self.core = EngineCore.from_config(config, self.checkpoint)
            self.tokenizer = tokenizer.result()
        self.model_config = self.core.model_config
        self.max_model_len = self.core.max_model_len
        self.input_processor = InputProcessor.for_model(
            self.tokenizer, self.model_config, self.max_model_len
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._closed = False

    def process_prompt(self, prompt: str | list[int]) -> ProcessedPrompt:
        return self.input_processor.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | ProcessedPrompt,
        params: SamplingParams,
        cache_salt: str | None = None,
        kv_retention: str | None = None,
    ) -> None:
        """Queues a request; a ValueError names a bad parameter and leaves nothing queued."""
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(prompt, ProcessedPrompt):
            prompt = self.process_prompt(prompt)
        core_request = self.input_processor.process(
            request_id, prompt, params, cache_salt, kv_retention=kv_retention
        )
        self.core.add_request(core_request)
        self.output_processor.add_request(request_id, prompt, params)

    def abort_request(self, request_id: str) -> None:
        if self.output_processor.abort(request_id):
            self.core.abort_requests([request_id])

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        outputs, stopped = self.output_processor.process(self.core.step())
        self.core.abort_requests(stopped)
        return outputs

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.core.close()

    def stats(self) -> EngineStats:
        return self.core.stats()
