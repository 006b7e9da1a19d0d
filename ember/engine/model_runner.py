"""Runs one scheduled step: builds the batch tensors (ember.engine.step_inputs), runs
the model, samples.

Owns the model, the KV-cache tensors and the sampler, and loads the model's weights.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ember import cpus, startup
from ember.config import EngineConfig
from ember.distributed.executor import (
    AllocateKV,
    LeaderModel,
    MultiprocExecutor,
    check_parallel,
)
from ember.distributed.parallel import SKIP, PipelineStage, TPGroup, building
from ember.engine import precision
from ember.engine.attention import CPUPagedBackend, get_attention_backend
from ember.engine.kernels import cpu_kernels
from ember.engine.kv_spec import KVCacheSpec
from ember.engine.prompt_logprobs import PromptLogprobs, compute_prompt_logprobs
from ember.engine.sampler import Sampler
from ember.engine.scheduler import ScheduledRequest, SchedulerOutput
from ember.engine.step_inputs import Rows, batch_inputs, profile_batch
from ember.kv import buffers as kv_buffers
from ember.kv.layout import Piece, WorkerKV
from ember.loader.checkpoint import Checkpoint, Narrow
from ember.model_config import ModelConfig
from ember.models import get_model_class
from ember.models.layers import (
    BF16_MIN_ROWS,
    block_decode_summary,
    can_pack_for_cpu,
    planned_weight_bytes,
    use_int8_activations,
)
from ember.models.llama import LayerPass
from ember.models.moe import SparseMoE

logger = logging.getLogger("ember.engine")

CPU_KV_CACHE_CAP = 4 << 30  # default CPU KV budget is at most 4 GiB


@dataclass
class StepOutput:
    """The tokens of the sequences that reached the end of their known tokens (one each,
    or with drafts, the accepted ones and the next), their logprobs if asked for, and the
    prompt logprobs computed this step (by request id)."""

    request_ids: list[str]
    token_ids: list[list[int]]
    logprobs: list[list[dict[int, float]] | None]
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # what a drafter reads of the target (ModelRunner.features): each scheduled request's
    # rows of it, from the first position this step computed (by request id)
    features: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)

    def sampled(self) -> dict[str, list[int]]:
        """The tokens by request id."""
        return dict(zip(self.request_ids, self.token_ids, strict=True))


class ModelRunner:
    def __init__(
        self,
        engine_config: EngineConfig,
        model_config: ModelConfig,
        checkpoint: Checkpoint,
        max_model_len: int,
        model_cls: type[torch.nn.Module] | None = None,
        group: TPGroup | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        """`model_cls`: the module to build (a drafter's head), else the architecture's.
        `group`, `stage`: the tensor-parallel rank and pipeline stage this runner is
        (rank_worker); by default rank 0 of `engine_config.world_size` ranks, the others
        started here."""
        self.config = engine_config
        self.model_config = model_config
        self.device = engine_config.resolve_device()
        if group is None and engine_config.world_size == 1:  # ranks: rank_threads
            cpus.fit_torch_threads()
        # the activations' and the KV cache's dtype; on CPU a bf16 model keeps them fp32
        # (ember's CPU kernels are fp32) and stores only its matmul weights in bf16
        self.dtype = engine_config.resolve_dtype(self.device)
        self.weight_dtype = self.dtype
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            self.dtype = torch.float32
        self.block_size = engine_config.block_size
        self.max_model_len = max_model_len
        model_cls = model_cls or get_model_class(model_config.architecture)
        self.executor: MultiprocExecutor | None = None
        if group is None and engine_config.world_size > 1:
            check_parallel(engine_config, model_config, model_cls, self.device)
            self.executor = MultiprocExecutor(engine_config, max_model_len)
        try:
            if self.executor is not None:
                group, stage = self.executor.join()
            self.group = group or TPGroup()
            self.stage = stage or PipelineStage()
            with building(self.group, self.stage):
                self.kv_spec: KVCacheSpec = model_cls.kv_cache_spec(model_config)
                self.model = self._load_model(model_cls, checkpoint, max_model_len)
            if self.executor is not None:
                self.executor.wait_ready()
                self.model = LeaderModel(self.model, self.executor, self.stage)
        except BaseException:
            if self.executor is not None:
                self.executor.close()
            raise
        self.kv_dtype = self._kv_dtype()
        # the layers whose KV this rank keeps (a pipeline stage's)
        stage_layers = getattr(getattr(self.model, "model", None), "stage_layers", None)
        self.kv_layers = list(stage_layers or range(model_config.num_hidden_layers))
        self.num_kv_layers = len(self.kv_layers)
        layers = getattr(getattr(self.model, "model", None), "layers", [])
        self.moe_layers = [
            (i, x.mlp)
            for i, x in enumerate(layers)
            if isinstance(getattr(x, "mlp", None), SparseMoE)
        ]
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.kv_shm_path: str | None = None
        # every rank's KV as the KV connectors see it (ember.kv.layout); None while a
        # model over ranks keeps each rank's KV to that rank
        self.worker_kv: WorkerKV | None = None
        # set by a drafter that reads the target's hidden states (EAGLE-3, MTP): from a
        # step's hidden states [rows, hidden] (before the final norm), what it reads
        self.features: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _load_model(self, model_cls, checkpoint: Checkpoint, max_model_len: int) -> torch.nn.Module:
        packs = can_pack_for_cpu(self.device, self.dtype)
        # refused before any weight is read
        self.prefill_precision = (
            precision.prefill_precision(self.config, checkpoint.tiled_share())
            if packs
            else "model dtype"
        )
        self.int8_decode = False  # decode steps on GGUF blocks in int8 (_load_weights)
        self.bf16_prefill = bf16_prefill = self.prefill_precision == "bf16"
        backend = get_attention_backend(self.config.attention_backend, self.device, self.dtype)
        # int8 steps' chunks attend in bf16 where that is faster (their KV in bf16 then)
        self.bf16_attention = bf16_prefill
        cpu_bf16 = isinstance(backend, CPUPagedBackend) and backend.attends_bf16
        if cpu_bf16 and precision.bf16_chunk_attention(self.prefill_precision):
            self.bf16_attention = backend.bf16_chunks = True

        def build(device: torch.device | str) -> torch.nn.Module:
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                with torch.device(device):
                    return model_cls(self.model_config, backend, max_model_len)
            finally:
                torch.set_default_dtype(default_dtype)

        model = build(self.device)
        startup.mark("model built")  # with the CPU kernels loaded (the attention backend)
        if self.config.max_rank_memory is not None:  # on a copy of shapes only
            self._check_rank_memory(build("meta"), checkpoint, packs, bf16_prefill)
        with _loading_threads():
            self._load_weights(model, checkpoint, packs, bf16_prefill)
        return model.eval()

    def _load_weights(
        self, model: torch.nn.Module, checkpoint: Checkpoint, packs: bool, bf16_prefill: bool
    ) -> None:
        # a tensor-parallel rank reads only its part of each split tensor
        narrow = model.shard_of if self.group.size > 1 else None
        blocks = self._reads_blocks(checkpoint, packs)
        from_blocks: set[str] = set()
        if blocks:  # first: a matmul that will read only its blocks skips its fp32 W
            from_blocks = self._load_blocks(model, checkpoint, narrow, bf16_prefill)
        if from_blocks:
            model.load_weights(checkpoint.weights(_skipping(from_blocks, narrow)), from_blocks)
        else:
            model.load_weights(checkpoint.weights(narrow))
        startup.mark("weights")
        if packs:
            if blocks:
                self.int8_decode = self._mark_int8(model)
            model.pack_for_cpu(bf16_prefill, self.weight_dtype)
            if summary := block_decode_summary(model):
                logger.info(summary)
            startup.mark("packed")
        elif self.weight_dtype != self.dtype:
            raise ValueError(
                f"dtype {self.weight_dtype} on CPU needs oneDNN (torch.backends.mkldnn)"
            )

    def _reads_blocks(self, checkpoint: Checkpoint, packs: bool) -> bool:
        """Whether decode steps will read a GGUF file's blocks (CPU, float32 weights)."""
        return (
            packs
            and checkpoint.is_gguf
            and self.config.gguf_blocks
            and self.weight_dtype == torch.float32
        )

    def _load_blocks(
        self, model, checkpoint: Checkpoint, narrow: Narrow | None, bf16_prefill: bool,
        shapes_only: bool = False,
    ) -> set[str]:  # fmt: skip
        """Hands `model` the file's blocks (meta tensors of their shapes, `shapes_only`);
        the checkpoint tensors not to read, their matmuls reading only blocks."""
        model.load_gguf_blocks(checkpoint.gguf_blocks(narrow, shapes_only))
        if hasattr(model, "weights_from_blocks"):
            # EAGLE-3's and MTP's drafts look tokens up in the target's table as floats
            shared = self.config.speculative_method in ("eagle3", "mtp")
            return model.weights_from_blocks(cpu_kernels(), bf16_prefill, table_shared=shared)
        return set()

    def _check_rank_memory(
        self, twin: torch.nn.Module, checkpoint: Checkpoint, packs: bool, bf16_prefill: bool
    ) -> None:
        """Refuses, before any weight is read, a model whose share on this rank does not fit
        max_rank_memory: what its weights will hold (planned_weight_bytes: parameters,
        oneDNN's packed copies of its matmul weights, in bf16 under bf16_prefill, GGUF
        blocks, and no fp32 W for a matmul that reads only blocks), and kv_cache_memory
        where given. `twin`: the model built on the meta device, which this fills with
        the shapes of the file's blocks. Layers a config declares and a checkpoint lacks
        (MTP layers that transformers does not save) count too."""
        limit = self.config.max_rank_memory
        blocks = self._reads_blocks(checkpoint, packs)
        if blocks:
            narrow = twin.shard_of if self.group.size > 1 else None
            self._load_blocks(twin, checkpoint, narrow, bf16_prefill, shapes_only=True)
            self._mark_int8(twin)  # tiles that take every row have no packed copy
        packed = (2 if bf16_prefill else self.weight_dtype.itemsize) if packs else 0
        weights = planned_weight_bytes(twin, cpu_kernels() if blocks else None, packed)
        need = weights + (self.config.kv_cache_memory or 0)
        if need > limit:
            ranks = self.group.size * -(-need // limit)
            raise ValueError(
                f"max_rank_memory={limit}: rank {self.group.rank}'s share of the model needs "
                f"about {need / 2**30:.2f} GiB (weights and packed copies"
                f"{', kv_cache_memory' if self.config.kv_cache_memory else ''}); split it over "
                f"more processes, e.g. tensor_parallel_size={ranks}"
            )

    def _kv_dtype(self) -> torch.dtype:
        """The KV cache's element type (EngineConfig.kv_cache_dtype): auto is bfloat16 for
        a cache of keys and values on a CPU whose prefill attends in bf16 (bf16 steps, and
        int8 ones where bf16_chunk_attention), which rounds them to bf16 already (ember's
        kernels widen a bf16 cache as they read it), else the activations' dtype."""
        choice = self.config.kv_cache_dtype
        if choice != "auto":
            return getattr(torch, choice)
        if self.device.type == "cpu" and self.bf16_attention and self.kv_spec.num_parts == 2:
            return torch.bfloat16
        return self.dtype

    def _mark_int8(self, model: torch.nn.Module) -> bool:
        """Before packing (or planning) a model with GGUF blocks: its matmuls' int8 rows
        (every row under prefill_precision int8); whether there are any."""
        int8 = precision.int8_decode(self.config, self.prefill_precision)
        if int8:
            use_int8_activations(model, every_row=self.prefill_precision == "int8")
        return int8

    def expert_tokens(self) -> list[tuple[int, list[int]]]:
        """(layer, tokens routed to each expert since start) for every MoE layer (summed
        over the ranks under data-parallel attention, where each counts its own)."""
        counts = [moe.experts.tokens_per_expert.tolist() for _, moe in self.moe_layers]
        if self.executor is not None and self.group.data_parallel_attention:
            for rank in self.executor.expert_counts():
                counts = [[a + b for a, b in zip(x, y, strict=True)] for x, y in zip(counts, rank, strict=True)]  # fmt: skip
        return [(i, layer) for (i, _), layer in zip(self.moe_layers, counts, strict=True)]

    # -- KV cache -----------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        """A KV block's bytes on this rank, or on the rank with the most (rank 0 of a
        tensor-parallel model: every rank has as many blocks)."""
        per_token = self.kv_spec.token_bytes(self.kv_dtype)
        own = self.num_kv_layers * self.block_size * per_token
        ranks = self.executor.rank_block_bytes if self.executor is not None else []
        return max([own, *ranks])

    def weight_bytes(self) -> int:
        """Bytes of this rank's loaded weights (see module_weight_bytes)."""
        model = self.model.inner if isinstance(self.model, LeaderModel) else self.model
        return module_weight_bytes(model)

    def kv_cache_budget(self) -> int:
        """Bytes for the KV cache: the user's figure, or a share of free memory."""
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.config.max_rank_memory is not None:  # what this rank's weights leave
            return max(self.config.max_rank_memory - self.weight_bytes(), 0)
        fraction = self.config.kv_cache_memory_fraction
        if self.device.type == "cuda":
            self._profile_peak_memory()
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * (fraction or 0.9))
        # a model's ranks share this host's memory: a share each
        ranks_here = self.config.world_size // self.config.nnodes
        share = _available_host_memory() * (fraction or 0.5) / ranks_here
        return min(int(share), CPU_KV_CACHE_CAP)

    @property
    def kv_pieces(self) -> list[Piece]:
        """What each of this rank's KV tensors holds: its layer and KV heads."""
        spec = self.kv_spec
        return [Piece(i, spec.head_start, spec.head_start + spec.num_heads) for i in self.kv_layers]

    def allocate_kv_cache(self, num_blocks: int, shared: bool = False) -> None:
        """Allocates the KV tensors; `shared` (CPU only): in one shared-memory file, with
        every rank's tensors when the model spans ranks (ember.kv.layout), so that the KV
        connectors here reach them all."""
        shape = self.kv_spec.shape(num_blocks, self.block_size)
        pieces = self.kv_pieces
        if shared and self.device.type == "cpu":
            others = self.executor.rank_kv_pieces if self.executor else []
            ranks = [pieces] + [[Piece(*piece) for piece in rank] for rank in others]
            every_piece = [piece for rank in ranks for piece in rank]
            shapes = [(*shape[:3], p.head_stop - p.head_start, shape[4]) for p in every_piece]
            tensors, path, offsets = kv_buffers.allocate_shared(shapes, self.kv_dtype)
            if self.executor is not None:  # each rank's offsets, in rank order after ours
                ends = list(itertools.accumulate(len(rank) for rank in ranks))
                rank_offsets = [offsets[a:b] for a, b in itertools.pairwise(ends)]
                self.executor.send(AllocateKV(num_blocks, path, rank_offsets))
            self.kv_caches, self.kv_shm_path = tensors[: len(pieces)], path
            self.worker_kv = WorkerKV.of(tensors, every_piece, path, offsets)
        else:
            if self.executor is not None:
                self.executor.send(AllocateKV(num_blocks))
            self.kv_caches, self.kv_shm_path = kv_buffers.allocate(
                shape, self.num_kv_layers, self.kv_dtype, self.device, shm=False
            )
            self.worker_kv = None if self.executor else WorkerKV.of(self.kv_caches, pieces)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GB, %s)",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_block_bytes / 1e9,
            str(self.kv_dtype).removeprefix("torch."),
        )

    def map_kv_cache(self, num_blocks: int, path: str, offsets: list[int]) -> None:
        """A rank > 0's KV tensors, in the file rank 0 allocated for every rank's."""
        shape = self.kv_spec.shape(num_blocks, self.block_size)
        self.kv_caches = kv_buffers.map_shared(path, [shape] * len(offsets), offsets, self.kv_dtype)

    def free_kv_cache(self) -> None:
        self.kv_caches = []
        self.worker_kv = None
        kv_buffers.remove_shm(self.kv_shm_path)
        self.kv_shm_path = None

    def close(self) -> None:
        """Frees the KV cache and stops the other ranks, if any."""
        self.free_kv_cache()
        if self.executor is not None:
            self.executor.close()

    def _profile_peak_memory(self) -> None:
        """Runs the largest step once before free memory is read."""
        ids, positions, meta, num_blocks = profile_batch(
            self.config.max_step_tokens, self.max_model_len, self.block_size, self.device
        )
        self.allocate_kv_cache(num_blocks)
        with torch.inference_mode():
            self.model(ids, positions, self.kv_caches, meta)
        self.kv_caches = []
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    # -- one step -----------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> StepOutput:
        return self.finish(self.submit(out))

    @torch.inference_mode()
    def submit(self, out: SchedulerOutput) -> PendingStep:
        """Starts a step: its forward pass, or under pipeline parallelism the first
        stage's part of it (the other stages go on while this process starts the next)."""
        if self.group.data_parallel_attention:
            return self._submit_ranks(out)
        batch = [s for s in out.scheduled if s.num_new_tokens == 1]
        num_decodes = len(batch)
        batch += [s for s in out.scheduled if s.num_new_tokens > 1]
        input_ids, positions, meta, sample_idx = self._prepare(batch, num_decodes)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return PendingStep(batch, hidden, sample_idx)

    @torch.inference_mode()
    def submit_sliced(self, out: SchedulerOutput, layers_per_slice: int) -> SlicedStep:
        """A step whose layers run `layers_per_slice` at a time (`run_slice`), other steps
        between the slices (a prompt's prefill, decode steps between: target_itl_ms); its
        inputs made and embedded now, no layer run yet. Then `finish` as any step."""
        start = time.perf_counter()
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        batch = decodes + [s for s in out.scheduled if s.num_new_tokens > 1]
        input_ids, positions, meta, sample_idx = self._prepare(batch, len(decodes))
        layer_pass = self.model.begin_layers(input_ids, positions, self.kv_caches, meta)
        step = SlicedStep(batch, None, sample_idx, layer_pass, layers_per_slice)
        step.ran(start)
        return step

    @torch.inference_mode()
    def run_slice(self, step: SlicedStep) -> bool:
        """The sliced step's next slice of layers; True once its last has run."""
        start = time.perf_counter()
        done = self.model.run_layers(step.layer_pass, step.layers_per_slice)
        if done:
            step.hidden, step.layer_pass = step.layer_pass.hidden, None
        step.ran(start)
        step.num_slices_run += 1
        step.slices_ms += (step.last_end - start) * 1e3
        return done

    @property
    def num_local_layers(self) -> int:
        """The decoder layers this process runs (its pipeline stage's)."""
        return len(self.kv_layers)

    def _submit_ranks(self, out: SchedulerOutput) -> PendingStep:
        """Data-parallel attention: each rank runs its own requests (ScheduledRequest.rank),
        in their blocks of its pool; the batch in rank order, as the hidden states come."""
        batch, inputs, samples, num_rows = [], [], [], 0
        for rank in range(self.group.size):
            mine = [s for s in out.scheduled if s.rank == rank]
            decodes = [s for s in mine if s.num_new_tokens == 1]
            part = decodes + [s for s in mine if s.num_new_tokens > 1]
            input_ids, positions, meta, sample_idx = self._prepare(part, len(decodes))
            inputs.append((input_ids, positions, meta))
            samples.append(sample_idx + num_rows)
            num_rows += len(input_ids)
            batch += part
        hidden = self.model.forward_ranks(inputs, self.kv_caches)
        return PendingStep(batch, hidden, torch.cat(samples))

    @torch.inference_mode()
    def finish(self, pending: PendingStep) -> StepOutput:
        """Ends a step: waits for its hidden states (the last stage's), samples."""
        batch, hidden, sample_idx = pending.batch, pending.hidden, pending.sample_idx
        if not isinstance(hidden, torch.Tensor):
            hidden = hidden.result()
        result = StepOutput([], [], [])
        if any(s.request.needs_prompt_logprobs for s in batch):
            result.prompt_logprobs = compute_prompt_logprobs(self.model, hidden, batch)
        if self.features is not None:
            result.features = self._features(batch, hidden)
        sampling = [s for s in batch if s.samples]
        if not sampling:
            return result
        result.request_ids = [s.request.request_id for s in sampling]
        requests = [s.request for s in sampling]
        if any(s.spec_token_ids for s in sampling):
            logits = self._verify_logits(hidden[sample_idx], len(sampling))
            drafts = [s.spec_token_ids for s in sampling]
            result.token_ids, result.logprobs = self.sampler.verify(logits, requests, drafts)
            return result
        out = self.sampler(self.model.compute_logits(hidden[sample_idx]), requests)
        result.token_ids = [[t] for t in out.token_ids]
        result.logprobs = [None if e is None else [e] for e in out.logprobs]
        return result

    def _features(self, batch: list[ScheduledRequest], hidden: torch.Tensor):
        """Each request's rows of `self.features(hidden)`, in `_prepare`'s row order, with
        the position of its first row."""
        features = self.features(hidden)
        out, row = {}, 0
        for sched in batch:
            num = sched.num_new_tokens + len(sched.spec_token_ids)
            out[sched.request.request_id] = (
                sched.start,
                features[row : row + num].clone(),
            )
            row += num
        return out

    def _verify_logits(self, hidden: torch.Tensor, num_seqs: int) -> torch.Tensor:
        """Logits of verification rows in the precision their sequences' decodes would
        have (bf16_prefill: fp32 below BF16_MIN_ROWS sequences, however many rows)."""
        if not self.bf16_prefill or num_seqs >= BF16_MIN_ROWS:
            return self.model.compute_logits(hidden)
        chunks = hidden.split(BF16_MIN_ROWS - 1)
        return torch.cat([self.model.compute_logits(chunk) for chunk in chunks])

    def _prepare(self, batch: list[ScheduledRequest], num_decodes: int):
        """Input ids, positions, attention metadata and the rows to sample, for a batch
        whose first `num_decodes` entries compute one known token each (and their drafts)."""
        rows = []
        for i, sched in enumerate(batch):
            start = sched.start
            if i < num_decodes:
                tokens = [sched.request.token_ids[start], *sched.spec_token_ids]
            else:
                tokens = sched.request.token_ids[start : start + sched.num_new_tokens]
            rows.append(Rows(tokens, start, sched.block_ids, sched.samples))
        return batch_inputs(rows[:num_decodes], rows[num_decodes:], self.block_size, self.device)


@dataclass
class PendingStep:
    """A step submitted to the model: its batch in row order, its hidden states (or what
    will give them: the pipeline's last stage), and the rows to sample."""

    batch: list[ScheduledRequest]
    hidden: torch.Tensor | Any
    sample_idx: torch.Tensor


@dataclass
class SlicedStep(PendingStep):
    """A step run a slice of layers at a time (ModelRunner.submit_sliced): `hidden` is
    set once the last slice has run; `run_ms`, the slices' time so far."""

    layer_pass: LayerPass | None = None
    layers_per_slice: int = 1
    run_ms: float = 0.0
    slice_ms: float = 0.0  # a slice's predicted time
    decoded: bool = False  # a decode step ran since its last slice
    last_end: float = 0.0  # time.perf_counter() when its last piece of work ended
    num_slices_run: int = 0
    slices_ms: float = 0.0  # what they took

    def next_slice_ms(self) -> float:
        """The next slice's time: what the slices so far took each, or as predicted."""
        return self.slices_ms / self.num_slices_run if self.num_slices_run else self.slice_ms

    def ran(self, start: float) -> None:
        """Counts a piece of its work that began at `start` and ends now."""
        self.last_end = time.perf_counter()
        self.run_ms += (self.last_end - start) * 1e3

    def own_ms(self) -> float:
        """Its time: its inputs and slices, and since the last slice (sampling)."""
        return self.run_ms + (time.perf_counter() - self.last_end) * 1e3


@contextlib.contextmanager
def _loading_threads():
    """One torch thread fewer than usual while the weights load (at least one): the API
    process starts alongside (imports, tokenizer), and loading is many small ops, each a
    parallel region whose threads spin at its barrier (GOMP_SPINCOUNT, see envs) while a
    peer waits for a core. Measured on the 2-core box, loaded: SmolLM2's weights in 2.1 s
    wall / 1.1 CPU s with one thread, 15 s / 7.6 CPU s with two."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, num_threads - 1))
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


def _skipping(names: set[str], narrow: Narrow | None) -> Narrow:
    """`narrow` (a rank's part of each tensor, or all of it), with `names` not read."""
    return lambda name: SKIP if name in names else (narrow(name) if narrow else None)


def module_weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's loaded weights (each tensor once; packed copies and GGUF
    blocks too, a fused matmul's parts and MoE experts' among them; not tables such as
    rotary's cos/sin)."""
    seen, total = set(), 0
    tensors = list(module.parameters())
    for m in module.modules():  # packed copies; blocks: one tensor, parts, or by name
        for name in ("packed", "blocks", "block_parts"):
            held = getattr(m, name, None)
            held = held.values() if isinstance(held, dict) else held
            held = [held] if isinstance(held, torch.Tensor) else held or []
            tensors += [t for t in held if isinstance(t, torch.Tensor)]
    for tensor in tensors:
        if tensor.is_meta:  # a weight whose matmuls read only its blocks and packed copy
            continue
        if tensor.is_mkldnn or tensor.layout != torch.strided:  # oneDNN's opaque copy
            key, size = id(tensor), tensor.numel() * tensor.element_size()
        else:
            key, size = tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
        if key not in seen:
            seen.add(key)
            total += size
    return total


def _available_host_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 << 30
