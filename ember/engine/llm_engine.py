"""The frontend and the engine core in one process: what `LLM` and `AsyncLLM` drive.

`add_request` checks and tokenizes, `step` runs one engine step and returns the
RequestOutputs it changed, `abort_request` ends a request at any moment.
"""

from __future__ import annotations

import logging

import torch

from ember.config import EngineConfig, ModelConfig
from ember.engine.core import EngineCore, EngineStats
from ember.engine.output_processor import OutputProcessor
from ember.engine.processor import InputProcessor, ProcessedPrompt
from ember.loader.checkpoint import open_checkpoint
from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams

logger = logging.getLogger("ember.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from ember.loader.default_models import resolve_model

        torch.manual_seed(config.seed)
        self.checkpoint = checkpoint = open_checkpoint(resolve_model(config.model))
        self.model_config = ModelConfig.from_hf(checkpoint.hf_config)
        self.tokenizer = checkpoint.tokenizer()
        self.core = EngineCore(config, self.model_config, checkpoint)
        self.max_model_len = self.core.max_model_len
        self.input_processor = InputProcessor(
            self.tokenizer, self.model_config.vocab_size, self.max_model_len, self._eos_ids()
        )
        self.output_processor = OutputProcessor(self.tokenizer)

    def _eos_ids(self) -> frozenset[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def process_prompt(self, prompt: str | list[int]) -> ProcessedPrompt:
        return self.input_processor.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | ProcessedPrompt,
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> None:
        """Queues a request; a ValueError names a bad parameter and leaves nothing queued."""
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(prompt, ProcessedPrompt):
            prompt = self.process_prompt(prompt)
        requests = self.input_processor.make_requests(request_id, prompt, params, cache_salt)
        self.output_processor.add_request(
            request_id, prompt, params, [r.request_id for r in requests]
        )
        for request in requests:
            self.core.add_request(request)

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.abort(request_id))

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        outputs, stopped = self.output_processor.process(self.core.step())
        self.core.abort_requests(stopped)
        return outputs

    def stats(self) -> EngineStats:
        return self.core.stats()
