"""A core request made into the engine's sequences, and what it carries checked again.

A user request with n > 1 becomes n sequences `{id}#{i}`; each after the first waits for
the first's prompt blocks and shares them. What came from another process (a prefill
worker's hand-over, a resumed stream's tokens) was checked by the frontend; it is checked
again here, against this engine's model and cache, so that no request, whatever it holds,
can fail a step: a bad one raises ValueError and nothing of it is queued.
"""

from __future__ import annotations

from ember.config import EngineConfig
from ember.engine.grammar_masks import GrammarCompiler, GrammarMatcher
from ember.engine.messages import EngineCoreRequest
from ember.engine.model_runner import ModelRunner
from ember.engine.request import Request
from ember.kv.connector import MultiConnector
from ember.loader.checkpoint import Checkpoint


class RequestIntake:
    def __init__(
        self,
        config: EngineConfig,
        vocab_size: int,
        checkpoint: Checkpoint,
        runner: ModelRunner,
        connector: MultiConnector,
    ) -> None:
        self.block_size = config.block_size
        self.vocab_size = vocab_size
        self.checkpoint = checkpoint
        self.runner = runner
        self.connector = connector
        self._grammars: GrammarCompiler | None = None  # made on the first grammar

    def make_sequences(self, core_request: EngineCoreRequest) -> list[Request]:
        """The request's sequences, its first carrying a handed-over prefill's first
        tokens or a resumed stream's output so far."""
        params = core_request.params
        kv = core_request.kv_transfer
        remote = kv.remote_prefill if kv is not None else None
        if kv is not None and params.n > 1:
            raise ValueError("kv_transfer_params: only requests with n = 1 can be disaggregated")
        if remote is not None:
            self._check_remote(remote, core_request)
        requests: list[Request] = []
        for i in range(params.n):
            request_id = core_request.request_id
            requests.append(
                Request(
                    request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                    prompt_token_ids=core_request.prompt_token_ids,
                    sampling_params=params.sibling(i),
                    max_tokens=core_request.max_tokens,
                    eos_token_ids=frozenset(core_request.eos_token_ids),
                    cache_salt=core_request.cache_salt,
                    retain_kv=core_request.session_id is not None
                    or core_request.kv_retention == "session",
                    wait_for=requests[0] if requests else None,
                    grammar=self._matcher(core_request.grammar),
                    kv_transfer=kv,
                )
            )
        if remote is not None:  # the prefill worker's first token is already output
            request = requests[0]
            for token_id in remote.first_token_ids:
                request.token_ids.append(token_id)
                if request.grammar is not None:
                    request.grammar.accept(token_id)
        if core_request.resume_token_ids:  # output on another worker: recomputed here
            self._resume(requests, core_request.resume_token_ids, core_request.max_tokens)
        return requests

    def _resume(self, requests: list[Request], token_ids: list[int], max_tokens: int) -> None:
        """Makes `token_ids` the output so far of a resumed stream."""
        if len(requests) != 1 or not len(token_ids) < max_tokens:
            raise ValueError("resume_params: only n = 1, with tokens left to generate")
        (request,) = requests
        vocab = self.vocab_size
        if not all(0 <= t < vocab for t in token_ids):
            raise ValueError(f"resume_params: token_ids must be in [0, {vocab})")
        grammar = request.grammar
        if grammar is not None:
            if grammar.valid_prefix(token_ids) != len(token_ids):
                raise ValueError("resume_params: token_ids do not follow the request's grammar")
            if any(grammar.accept(t) for t in token_ids):
                raise ValueError("resume_params: the grammar ended within token_ids")
        request.token_ids.extend(token_ids)

    def _check_remote(self, remote, core_request: EngineCoreRequest) -> None:
        """What a handed-over prefill must match here (the frontend checked its signature)."""
        remote.check()
        vocab = self.vocab_size
        if not all(t < vocab for t in remote.first_token_ids):
            raise ValueError(f"kv_transfer_params: first_token_ids must be in [0, {vocab})")
        if remote.block_size != self.block_size:
            raise ValueError(
                f"kv_transfer_params: block_size {remote.block_size} differs from this "
                f"worker's {self.block_size}"
            )
        if self.connector.get("disagg") is None:
            raise ValueError(
                "kv_transfer_params: this worker takes no handed-over prefills (a model over "
                "ranks takes them as a decode worker: kv_role decode)"
            )
        try:
            self.runner.worker_kv.check_sender(remote.pieces(), remote.block_bytes)
        except ValueError as exc:
            raise ValueError(f"kv_transfer_params: {exc}") from None
        if remote.num_tokens != len(core_request.prompt_token_ids):
            raise ValueError(
                f"kv_transfer_params: the prefill worker held {remote.num_tokens} prompt "
                f"tokens, this request has {len(core_request.prompt_token_ids)}"
            )
        if not 0 < len(remote.first_token_ids) < core_request.max_tokens:
            raise ValueError("kv_transfer_params: first_token_ids must leave tokens to generate")
        if len(remote.block_ids) != -(-remote.num_tokens // remote.block_size):
            raise ValueError("kv_transfer_params: block_ids do not cover the prompt")

    def _matcher(self, grammar: str | None) -> GrammarMatcher | None:
        if grammar is None:
            return None
        if self._grammars is None:
            tokenizer = self.checkpoint.tokenizer()
            self._grammars = GrammarCompiler(tokenizer, self.vocab_size)
        return self._grammars.matcher(grammar)
