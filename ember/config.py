"""Configuration, resolved once and passed narrowly.

`EngineConfig` holds the engine options a user sets (what a model file needs,
`ModelConfig`, is `ember.model_config`'s); values discovered at run time (the number of
KV blocks, the device actually used) are returned by the components that find them,
never written back here.

torch is imported only by the methods that resolve a device or dtype: the API process
reads this config too, and does without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ember import envs

if TYPE_CHECKING:
    import torch


# speculative decoding's proposers (ember.engine.speculative.METHODS)
SPECULATIVE_METHODS = ("ngram", "draft", "eagle3", "mtp")
# which prompt a step's prefill tokens go to first (ember.engine.scheduler)
SCHEDULING_POLICIES = ("shortest", "fcfs")
# methods whose speculative_model is the drafter (eagle3: a head over the model's states)
SPECULATIVE_MODEL_METHODS = ("draft", "eagle3")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """Options a user sets when building an engine (`LLM(model, **options)`)."""

    model: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: sized from free memory
    # share of free memory for the KV cache when kv_cache_memory is None;
    # None: 0.5 of available RAM on CPU (at most 4 GiB), 0.9 of free GPU memory on CUDA
    kv_cache_memory_fraction: float | None = None
    max_model_len: int | None = None  # None: the model's own context length
    # tokens per step (prompts are chunked to fit; vLLM's CPU server takes 2,048): 1,024
    # cut the first turn of agent sessions that arrive together by a sixth against 512
    max_num_batched_tokens: int = 1024
    # with no sequence decoding, a step may go past max_num_batched_tokens, up to this
    # many tokens (and within max_step_ms, predicted), for prompts that then finish their
    # prefill in it (a burst of prompts sharing a prefix, or a few short ones: one step,
    # not two); at most max_num_batched_tokens: off
    max_prefill_step_tokens: int = 2048
    # an idle engine that gets a request while the server is still tokenizing others
    # waits up to this long for them, so that requests that came together share a step
    # (0: never waits; see EngineCore.hold_ms)
    batch_wait_ms: float = 25.0
    max_num_seqs: int = 64
    # the step budget: while decodes run, prefill chunks shrink so that a step's predicted
    # time stays within max_step_ms (0: off, chunks fill max_num_batched_tokens), but
    # never below min_prefill_tokens, so long prompts keep moving
    max_step_ms: float = 250.0
    # while sequences decode, a prompt chunk that would keep their next token past this
    # many ms after their last runs its layers in slices, and the decodes take steps of
    # their own between slices whenever the next slice would pass it (EngineCore;
    # 0: off; None: auto, a share of what a 512-token prompt takes on this machine, by
    # the step cost model: EngineCore.target_itl_ms; one process on CPU, no speculative
    # decoding)
    target_itl_ms: float | None = None
    min_prefill_tokens: int = 16
    # which prompt a step's prefill budget goes to first: "shortest" (highest response
    # ratio: a short prompt before a long one, none starved; see Scheduler) or "fcfs"
    # (arrival order). Measured on the conversation trace: TTFT p90 lower in 5 of 6 pairs
    scheduling_policy: str = "shortest"
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto | sdpa | cpu-paged
    # CPU steps of 16+ tokens (prefill, large decode batches): "ieee" (exact fp32), "bf16"
    # (matmuls on a bf16 copy of the weights packed once, bf16 activations between them,
    # on AMX / AVX-512 BF16; refused on CPUs without them), "int8" (a GGUF file's blocks
    # that tile multiply every row on int8 activations, as decode steps do; other matmuls
    # exact fp32) or "auto" (bf16 on AMX; else int8 where the tiles sum on AVX512-VNNI, for
    # a file mostly in such blocks; else bf16 where it outruns fp32, AVX-512
    # BF16 on AMD; else ieee for prefill, int8 decode). The
    # default is auto, or $EMBER_MATMUL_PRECISION where set: an environment variable
    # reaches the engines of child processes too
    matmul_precision: str = field(default_factory=envs.matmul_precision)
    # CPU decode steps of a GGUF model read its matrices in the block formats ember decodes
    # (gguf_loader.BLOCK_FORMATS: Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K) as the file's blocks,
    # decoded in registers to exactly the fp32 weights (same results, 2-3x faster)
    gguf_blocks: bool = True
    # how those block steps of few rows (1-3 by format, layers.INT8_ROWS) take their
    # activations: "fp32" (exact), "int8" (each row rounded to int8 per 32 values, as
    # llama.cpp does, and integer products) or "auto" (int8 unless matmul_precision is
    # ieee, on the x86 builds)
    decode_activations: str = "auto"
    # the KV cache's element type: "float32", "bfloat16" (half the bytes a token keeps:
    # twice the tokens per GB, half the bytes attention reads) or "auto": bfloat16 for keys
    # and values on a CPU whose prefill runs in bf16 (matmul_precision bf16, or auto on a
    # CPU with AMX or AVX-512 BF16), whose prefill attention rounds them to bf16 anyway;
    # else the activations' dtype (float32 on CPU, the model's on CUDA)
    kv_cache_dtype: str = "auto"
    seed: int = 0
    # disaggregation (the KV connector); the cluster secret comes from $EMBER_CLUSTER_SECRET
    kv_role: str = "mixed"  # mixed | prefill | decode
    kv_transport: str = "auto"  # auto (shm on one host, else tcp) | tcp | shm | mooncake | fake
    kv_host: str = "127.0.0.1"  # a prefill worker's KV endpoint binds and advertises this
    kv_port: int = 0  # 0: any free port
    kv_hold_timeout: float = 30.0  # seconds a prefill keeps blocks no decode worker fetched
    kv_load_timeout: float = 10.0  # seconds a decode worker waits on a transfer's socket
    kv_checksum: bool = False  # CRC-32 over every transfer (costs about a third of its speed)
    kv_fake_fault: str | None = None  # the fake transport's fault (tests)
    # the KV connectors an engine runs, in order (ember.kv.connector): disagg, tiers (when
    # a tier is configured), or module:factory of your own
    kv_connectors: tuple[str, ...] = ("disagg", "tiers")
    # tiers below the pool (ember.kv.tiers): bytes of host memory for blocks that leave
    # the pool, and a directory (and its size) where they are kept on disk across restarts
    kv_offload_memory: int | None = None
    kv_disk_dir: str | None = None
    kv_disk_size: int = 16 << 30
    # the cluster tier: mooncake://HOST:PORT, a Mooncake Store master every worker shares
    # (values signed with $EMBER_CLUSTER_SECRET), and the memory this worker adds to its pool
    kv_store: str | None = None
    kv_store_memory: int = 0
    # seconds an agent session's blocks (x-session-affinity, kv_retention "session") stay
    # protected on disk (and soft-pinned in the store) after their last save
    session_ttl: float = 3600.0
    # when computed blocks go into the tiers: computed | finished | evicted
    # (ember.kv.store_connector.SAVE_POLICIES; docs/benchmarks.md for the choice)
    kv_save: str = "computed"
    # speculative decoding (ember.engine.speculative): a proposer of draft tokens (None:
    # off; "ngram": prompt lookup; "draft": speculative_model, a smaller model with the
    # same tokenizer; "eagle3": speculative_model, an EAGLE-3 head; "mtp": the model's
    # own multi-token-prediction layer), at most num_speculative_tokens per request and
    # step, fewer (down to none for a while) where they are not accepted, and only those
    # that pay at the step's batch size (ember.engine.spec_planner), unless not adaptive
    speculative_method: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int = 4
    speculative_adaptive: bool = True
    # no drafts in a step where at least this many sequences decode (None: always drafts)
    speculative_disable_by_batch_size: int | None = None
    # ngram: the shortest and longest suffix looked up in the request's earlier tokens
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # one model over this many processes (tensor parallel, ember.distributed): rank 0 in
    # the engine core, the others started by it; each rank holds its share of every
    # weight matrix and of the KV heads, and its share of the cores. kv_cache_memory is
    # per rank (by default the ranks split the share of host memory)
    tensor_parallel_size: int = 1
    # bytes one process (rank) may take for its weights and KV cache: a model whose share
    # does not fit is refused before its weights are read; without kv_cache_memory, the
    # KV cache gets what the weights leave (ModelRunner.kv_cache_budget)
    max_rank_memory: int | None = None
    # mixture-of-experts layers over those ranks by expert (each rank a range of the
    # experts, whole) rather than within each expert (each rank a share of every
    # expert's width); every token routed on every rank, the shares summed over them
    expert_parallel: bool = False
    # the model's layers over this many stages of tensor_parallel_size ranks each
    # (pipeline parallel): each stage a contiguous range of layers and their KV cache,
    # the first the embedding and head too; as many steps in flight as stages
    pipeline_parallel_size: int = 1
    # attention data-parallel over the tensor_parallel_size ranks (a mixture-of-experts
    # model): each rank holds the whole model but the experts (split as above) and runs
    # its own sequences, whose KV only it keeps (MLA's latents once, not on every rank);
    # each MoE layer brings every rank's tokens to the experts and back (moe_dispatch)
    data_parallel_attention: bool = False
    # how, under data_parallel_attention: "all-gather" (every rank every token, its share
    # summed back by a reduce-scatter) or "all-to-all" (each token only to its experts'
    # ranks; expert_parallel only); "auto": all-gather, the faster measured here
    # (docs/benchmarks.md)
    moe_dispatch: str = "auto"
    # the ranks over this many hosts (each world_size / nnodes of them; rank 0, the engine
    # core, on the head), meeting at dist_init_addr, HOST:PORT on the head
    # (ember.distributed.nodes)
    nnodes: int = 1
    dist_init_addr: str | None = None

    @property
    def max_step_tokens(self) -> int:
        """The most tokens any step computes (what per-step buffers are sized for)."""
        return max(self.max_num_batched_tokens, self.max_prefill_step_tokens)

    @property
    def world_size(self) -> int:
        """The processes (ranks) one model runs over."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.max_rank_memory is not None:
            _positive("max_rank_memory", self.max_rank_memory)
        if self.world_size > 1 or self.data_parallel_attention or self.nnodes != 1:
            from ember.distributed.parallel import check_parallel_config

            check_parallel_config(self)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_prefill_step_tokens", self.max_prefill_step_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("min_prefill_tokens", self.min_prefill_tokens)
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        if self.speculative_disable_by_batch_size is not None:
            _positive("speculative_disable_by_batch_size", self.speculative_disable_by_batch_size)
        if self.speculative_method not in (None, *SPECULATIVE_METHODS):
            raise ValueError(
                f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)} (or None); "
                f"got {self.speculative_method!r}"
            )
        if (self.speculative_method in SPECULATIVE_MODEL_METHODS) != (
            self.speculative_model is not None
        ):
            raise ValueError(
                "speculative_model names the drafter of speculative_method 'draft' (a smaller "
                "model) or 'eagle3' (an EAGLE-3 head), and those methods need one"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max; got "
                f"{self.prompt_lookup_min!r} and {self.prompt_lookup_max!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        if not 0 <= self.batch_wait_ms <= 1000:
            raise ValueError(f"batch_wait_ms must be in [0, 1000], got {self.batch_wait_ms!r}")
        if not self.max_step_ms >= 0:
            raise ValueError(f"max_step_ms must be >= 0 (0: off), got {self.max_step_ms!r}")
        if self.target_itl_ms is not None and not self.target_itl_ms >= 0:
            raise ValueError(
                f"target_itl_ms must be >= 0 (0: off; None: auto), got {self.target_itl_ms!r}"
            )
        if self.kv_cache_memory is not None:
            _positive("kv_cache_memory", self.kv_cache_memory)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if (
            self.kv_cache_memory_fraction is not None
            and not 0.0 < self.kv_cache_memory_fraction <= 1.0
        ):
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}"
            )
        if self.attention_backend not in ("auto", "sdpa", "cpu-paged"):
            raise ValueError(
                f"attention_backend must be auto, sdpa or cpu-paged; got {self.attention_backend!r}"
            )
        if self.matmul_precision not in envs.MATMUL_PRECISIONS:
            raise ValueError(
                f"matmul_precision must be auto, ieee, bf16 or int8; got {self.matmul_precision!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}"
            )
        if self.decode_activations not in ("auto", "fp32", "int8"):
            raise ValueError(
                f"decode_activations must be auto, fp32 or int8; got {self.decode_activations!r}"
            )
        tiers = self.kv_tiers
        if tiers and not self.enable_prefix_caching:
            raise ValueError(
                "kv_offload_memory, kv_disk_dir and kv_store keep blocks by their prefix "
                "hashes: they need enable_prefix_caching"
            )
        for name in ("kv_offload_memory", "kv_disk_size"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        if self.kv_store is not None:
            from ember.kv.mooncake import parse_store_url

            parse_store_url(self.kv_store)
        if self.kv_save not in ("computed", "finished", "evicted"):
            raise ValueError(
                f"kv_save must be one of computed, finished, evicted; got {self.kv_save!r}"
            )
        if not self.session_ttl >= 0:
            raise ValueError(f"session_ttl must be >= 0 seconds, got {self.session_ttl!r}")
        if self.kv_store_memory < 0:
            raise ValueError(f"kv_store_memory must be >= 0 bytes, got {self.kv_store_memory}")
        if self.kv_role not in ("mixed", "prefill", "decode"):
            raise ValueError(f"kv_role must be mixed, prefill or decode; got {self.kv_role!r}")
        if self.kv_transport not in ("auto", "tcp", "shm", "mooncake", "fake"):
            raise ValueError(
                f"kv_transport must be auto, tcp, shm, mooncake or fake; got {self.kv_transport!r}"
            )
        for name in ("kv_hold_timeout", "kv_load_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N]; got {self.device!r}")
        if self.kv_role != "mixed" and self.device != "cpu" and self.resolve_device().type != "cpu":
            raise ValueError(
                f"kv_role {self.kv_role}: KV transfers move blocks through host memory, so "
                "disaggregated workers run on CPU for now; pass device cpu"
            )

    @property
    def kv_tiers(self) -> bool:
        """Whether any KV tier below the pool is asked for."""
        return bool(self.kv_offload_memory or self.kv_disk_dir or self.kv_store)

    @property
    def moves_kv(self) -> bool:
        """Whether KV connectors move this engine's blocks in or out (disaggregation, the
        tiers, or a connector of the user's), beyond a mixed worker's handed-over loads."""
        custom = set(self.kv_connectors) - {"disagg", "tiers"}
        return self.kv_role != "mixed" or self.kv_tiers or bool(custom)

    def resolve_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
