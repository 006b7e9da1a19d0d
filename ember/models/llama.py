"""The Llama family: Llama (1-3, SmolLM2), Mistral, Qwen2 (QKV bias), Qwen3 (q/k norm),
and their mixture-of-experts kin: Mixtral (Mistral with softmax-routed experts) and
Qwen3-MoE (Qwen3 with them on every `decoder_sparse_step`-th layer not in
`mlp_only_layers`).

Attribute names mirror Hugging Face's modeling files, so checkpoint keys map one to
one; q/k/v and gate/up are fused into one matmul each and loaded shard by shard; routed
experts are stacked (ember.models.moe) and Mixtral's `block_sparse_moe` is read as `mlp`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Set
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from ember.distributed.parallel import SKIP, head_split, pp_stage, tp_group
from ember.engine.attention import AttentionBackend, AttentionMetadata, CPUPagedBackend
from ember.engine.kv_spec import KVCacheSpec
from ember.model_config import ModelConfig
from ember.models.huge_pages import gather_blocks
from ember.models.layers import (
    BF16_MIN_ROWS,
    DECODE_BLOCK_MAX_ROWS,
    DECODE_TILE_MAX_ROWS,
    PACKED_MIN_ROWS,
    Linear,
    MergedLinear,
    RMSNorm,
    cpu_kernels_for,
    silu_and_mul,
    tiled,
)
from ember.models.moe import Experts, ExpertTensors, SparseMoE
from ember.models.parallel_layers import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_slices,
    shard_of,
)
from ember.models.rotary import RotaryEmbedding, apply_rotary

logger = logging.getLogger(__name__)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        group = tp_group()  # this rank's heads (all of them on one rank)
        heads = head_split(
            config.num_attention_heads, config.num_key_value_heads, group.size, group.rank
        )
        self.num_heads, self.num_kv_heads = heads.num_q, heads.num_kv
        self.head_dim = hd = config.head_dim
        q_rows, kv_rows = (
            (heads.q_start * hd, heads.num_q * hd),
            (heads.kv_start * hd, heads.num_kv * hd),
        )
        q_size = config.num_attention_heads * hd
        kv_size = config.num_key_value_heads * hd
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            [q_size, kv_size, kv_size],
            bias=config.attention_bias,
            slices=[q_rows, kv_rows, kv_rows],
        )
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, group, q_rows)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        # a bf16 step's qkv split and rotated by one kernel on CPU (no q/k norm between)
        self.fused_split = not config.qk_norm
        self.backend = backend
        self.scale = self.head_dim**-0.5

    def forward(self, hidden, kv_cache, meta: AttentionMetadata, cos_sin):
        num_tokens = hidden.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(hidden)
        attn_dtype = qkv.dtype  # bf16 in a bf16 prefill step on CPU, where the residual is fp32
        # q/k norm, rotary and the KV cache in the residual stream's dtype, rotary's tables'
        stream = cos_sin[0].dtype
        kernels = cpu_kernels_for(cos_sin[0]) if self.fused_split else None
        if kernels is not None and attn_dtype == torch.bfloat16 and qkv.dim() == 2:
            # widened, rotated and q rounded back in one pass (the same values)
            q, k, v = kernels.rotary_split_bf16(qkv, *cos_sin, self.num_heads, self.num_kv_heads)
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
            return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
        qkv = qkv.to(stream).view(num_tokens, num_qk_heads + self.num_kv_heads, -1)
        qk, v = qkv[:, :num_qk_heads], qkv[:, num_qk_heads:]
        if self.qk_norm:
            qk = torch.cat(
                [self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], 1
            )
        qk = apply_rotary(qk, *cos_sin)  # q and k heads rotated in one go
        q, k = qk[:, : self.num_heads].to(attn_dtype), qk[:, self.num_heads :]
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        group = tp_group()
        slices = column_slices([size, size], group)
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], slices=slices)
        self.down_proj = RowParallelLinear(size, config.hidden_size, group, slices[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rounded = self.down_proj.rounds_input(x.shape[0])
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), approx_exp=rounded))


def moe_or_dense_mlp(config: ModelConfig, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: the experts where the model has them there, else dense."""
    moe = config.moe
    if moe is None or not moe.is_moe_layer(layer):
        return LlamaMLP(config)
    shared = (
        LlamaMLP(config, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
    )
    return SparseMoE(config.hidden_size, moe, shared)


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[nn.Module] = LlamaAttention

    def __init__(self, config: ModelConfig, backend, index: int) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, backend)
        self.mlp = moe_or_dense_mlp(config, index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # in a bf16 step, the norms hand these their input in bf16 (their first op is a
        # bf16 matmul; MLA's and the experts' router are not)
        self.bf16_into_attention = isinstance(self.self_attn, LlamaAttention)
        self.bf16_into_mlp = isinstance(self.mlp, LlamaMLP)

    def forward(self, hidden, residual, kv_cache, meta, cos_sin):
        """Returns (this layer's MLP output, the residual stream before adding it)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual, self.bf16_into_attention)
        hidden = self.self_attn(hidden, kv_cache, meta, cos_sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual, self.bf16_into_mlp)
        return self.mlp(hidden), residual


# a layer's time is more than its matmuls' (attention, norms, rotary, a dozen small ops):
# the head counts for half its weights (SmolLM2 over 2 stages, batch 4 and 8 decode, head
# counted whole / half / not at all: 11 / 13 / 15 layers on the first stage, output
# 214-305 / 262-358 / 233-324 tok/s; docs/benchmarks.md)
HEAD_SHARE = 0.5


def head_layers(config: ModelConfig) -> float:
    """The LM head in layers' worth of time (the first pipeline stage holds it): its
    weights against a layer's (those a token reads), times HEAD_SHARE."""
    q, kv = (
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    hidden = config.hidden_size
    attention = hidden * (2 * q + 2 * kv)
    moe = config.moe
    if moe is None:
        mlp = 3 * hidden * config.intermediate_size
    else:  # the experts a token reads, and the shared expert
        mlp = 3 * hidden * (moe.top_k * moe.intermediate_size + moe.shared_intermediate_size)
    return HEAD_SHARE * config.vocab_size * hidden / (attention + mlp)


class OtherStage(nn.Module):
    """A layer (or the embedding, the norm) another pipeline stage holds: no weights."""


LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


class LlamaModel(nn.Module):
    layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, backend, max_positions: int):
        super().__init__()
        stage = pp_stage()  # this stage's layers (all of them without pipeline stages)
        self.stage_layers = stage.layers(config.num_hidden_layers, head_layers(config))
        self.first_stage = stage.first
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group())
            if stage.first
            else OtherStage()
        )
        self.layers = nn.ModuleList(
            self.layer_cls(config, backend, i) if i in self.stage_layers else OtherStage()
            for i in range(config.num_hidden_layers)
        )
        # this stage's layers, in order (their KV caches are the ones passed in)
        self.local_layers = [self.layers[i] for i in self.stage_layers]
        # the final norm where the head is (the first stage, which samples)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.first else None
        self.dtype = torch.get_default_dtype()
        self.rotary_emb = RotaryEmbedding(config.head_dim, max_positions, config.rope)
        self.fused_decode: FusedDecode | None = None  # set up by pack_for_cpu
        # under bf16_prefill: BF16_MIN_ROWS - 1, or DECODE_TILE_MAX_ROWS on int8 tiles
        self.fused_decode_max_rows = 1 << 30
        # EAGLE-3's drafter reads the residual stream before these layers (set by it)
        self.capture_layers: frozenset[int] = frozenset()
        self.captured: list[torch.Tensor] = []  # of the last forward, in layer order

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor `name` is one of this stage's."""
        match = LAYER_NAME.match(name)
        if match is not None:
            return int(match.group(1)) in self.stage_layers
        return self.first_stage  # the embedding, the final norm, the head

    def forward(self, input_ids, positions, kv_caches, meta, hidden=None):
        """The residual stream after this stage's layers (before the final norm);
        `hidden`: the previous stage's, which a later stage starts from."""
        if hidden is None:
            hidden = self.embed_tokens(input_ids).to(self.dtype)
        if not len(hidden):  # data-parallel attention: this rank has no sequence this step
            for layer in self.local_layers:  # but its experts serve the other ranks'
                if isinstance(layer.mlp, SparseMoE):
                    layer.mlp(hidden)
            return hidden
        cos_sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        self.captured = []
        # else bf16, in the layers below; drafts' rows run as their sequence's decode would
        rows = meta.num_decode_seqs or hidden.shape[0]
        fused = rows <= self.fused_decode_max_rows
        if self.fused_decode is not None and not meta.prefills and fused:
            capture = self._capture if self.capture_layers else None
            return self.fused_decode(hidden, cos_sin, kv_caches, meta, capture)
        layer_pass = LayerPass(hidden, kv_caches, meta, cos_sin)
        self.run_layers(layer_pass, len(self.local_layers))
        return layer_pass.hidden

    def begin_layers(self, input_ids, positions, kv_caches, meta) -> LayerPass:
        """A pass over this stage's layers (the first stage's, from `input_ids`) that
        `run_layers` takes a few layers at a time: a prompt's prefill in slices, with
        other sequences' decode steps between them (EngineConfig.target_itl_ms)."""
        hidden = self.embed_tokens(input_ids).to(self.dtype)
        self.captured = []
        return LayerPass(hidden, kv_caches, meta, self.rotary_emb.cos_sin(positions, hidden.dtype))

    def run_layers(self, layer_pass: LayerPass, num_layers: int) -> bool:
        """Runs the pass's next `num_layers` layers (or those left); True once it has run
        them all, `layer_pass.hidden` then being the residual stream after them."""
        hidden, residual, meta, cos_sin = (
            layer_pass.hidden, layer_pass.residual, layer_pass.meta, layer_pass.cos_sin
        )  # fmt: skip
        stop = min(layer_pass.next_layer + num_layers, len(self.local_layers))
        for local in range(layer_pass.next_layer, stop):
            i = self.stage_layers[local]
            self._capture(i, hidden, residual)
            layer, kv_cache = self.local_layers[local], layer_pass.kv_caches[local]
            hidden, residual = layer(hidden, residual, kv_cache, meta, cos_sin)
        layer_pass.next_layer = stop
        if stop < len(self.local_layers):
            layer_pass.hidden, layer_pass.residual = hidden, residual
            return False
        self._capture(self.stage_layers.stop, hidden, residual)
        layer_pass.hidden, layer_pass.residual = hidden + residual, None
        return True

    def _capture(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Keeps the residual stream before `layer` if asked for (a copy: the layers add
        to the residual in place)."""
        if layer in self.capture_layers:
            self.captured.append(hidden.clone() if residual is None else hidden + residual)


@dataclass
class LayerPass:
    """A forward pass between layers: the residual stream so far (`hidden`, `residual`
    as the last layer returned them; `hidden` alone, the input, before the first) and
    what every layer of the pass reads."""

    hidden: torch.Tensor
    kv_caches: list
    meta: AttentionMetadata
    cos_sin: tuple[torch.Tensor, torch.Tensor]
    residual: torch.Tensor | None = None
    next_layer: int = 0  # among the stage's layers


class FusedLayer(NamedTuple):
    """One layer's arguments to the C++ `decode_layer` (see its comments)."""

    weights: list[torch.Tensor]  # input norm, post norm, qkv, o, gate_up, down
    packed: list[torch.Tensor | None]  # the four matmuls' fp32 packed copies, if any
    blocks: list[list[torch.Tensor]]  # their GGUF blocks (Linear.block_list)
    qkv_bias: torch.Tensor | None
    block_max_rows: int  # the most rows multiplied on the blocks
    int8_max_rows: list[int]  # the most rows each multiplies on int8 activations


class FusedDecode:
    """Decode-only steps through ember's C++ `decode_layer`: one call per layer instead of
    ~25 Python-level ops (CPU, float32, paged CPU attention, no q/k norm)."""

    def __init__(self, model: LlamaModel, kernels) -> None:
        self.kernels = kernels
        layers = model.local_layers
        attn = layers[0].self_attn
        self.eps = layers[0].input_layernorm.eps
        self.shape = (attn.num_heads, attn.num_kv_heads)
        self.scale = attn.scale
        self.layers = [self._layer_args(layer) for layer in layers]
        # every matmul on int8 tiles, which take any number of rows
        self.tiled = all(tiled(m) for layer in layers for m in self._linears(layer))
        # tensor parallel: the kernel sums the o and down projections over the ranks
        group = attn.o_proj.group
        self.reduce = group.all_reduce if group.size > 1 else None
        # the same arguments held in C++, for a step's layers in one call (decode_layers)
        make = getattr(kernels, "DecodeLayerArgs", None)
        self.prepared = None if make is None else [make(*args) for args in self.layers]

    @staticmethod
    def _linears(layer: LlamaDecoderLayer) -> tuple[Linear, ...]:
        """The layer's four matmuls, in decode_layer's order: qkv, o, gate_up, down."""
        attn, mlp = layer.self_attn, layer.mlp
        return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj

    @staticmethod
    def _layer_args(layer: LlamaDecoderLayer) -> FusedLayer:
        attn = layer.self_attn
        linears = FusedDecode._linears(layer)
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        weights = norms + [lin.weight for lin in linears]
        # a bf16 packed copy under fp32 weights is for prefill only (bf16_prefill); tiles
        # that take every row have none (matmul_precision int8)
        packed = [
            lin.packed if lin.packed is not None and lin.packed.dtype == lin.weight.dtype else None
            for lin in linears
        ]
        # without a packed fp32 copy, the blocks take any number of rows (drafts' rows of
        # up to 15 sequences): one pass over them per 8 rows streams less than MKL does
        # over the fp32 weight (measured, Qwen2.5-1.5B Q4_K, 4 sequences of 5 rows: ~1.7x)
        block_max_rows = DECODE_BLOCK_MAX_ROWS if packed[0] is not None else 1 << 30
        blocks = [lin.block_list if lin.block_gemm is not None else [] for lin in linears]
        # tiles have no fp32 product: every row count they get multiplies on int8 (the
        # Python path gives them at most BLOCK_GEMM_MAX_ROWS, this one also decode-only
        # steps of more sequences, or drafts' rows)
        int8_max_rows = [1 << 30 if tiled(lin) else lin.int8_max_rows for lin in linears]
        return FusedLayer(
            weights, packed, blocks, attn.qkv_proj.bias, block_max_rows, int8_max_rows
        )

    def __call__(self, hidden, cos_sin, kv_caches, meta: AttentionMetadata, capture):
        """`capture`: None, or called with each layer's input (EAGLE-3's hidden states; a
        pipeline stage's layers capture nothing: EAGLE-3 runs on one stage)."""
        cos, sin = cos_sin
        if capture is None and self.prepared is not None:  # no Python between the layers
            return self.kernels.decode_layers(
                hidden, self.prepared, kv_caches, self.eps, *self.shape, cos, sin,
                meta.slot_mapping, meta.decode_block_table, meta.decode_context_lens,
                self.scale, PACKED_MIN_ROWS, self.reduce,
            )  # fmt: skip
        capture = capture or (lambda *_: None)
        residual = hidden
        for i, layer in enumerate(self.layers):
            capture(i, hidden, residual if i else None)
            hidden = self.kernels.decode_layer(
                hidden, residual, i == 0, layer.weights, layer.packed, layer.blocks,
                layer.qkv_bias, self.eps, *self.shape, cos, sin, kv_caches[i][0],
                kv_caches[i][1], meta.slot_mapping, meta.decode_block_table,
                meta.decode_context_lens, self.scale, PACKED_MIN_ROWS, layer.block_max_rows,
                layer.int8_max_rows, self.reduce,
            )  # fmt: skip
        capture(len(self.layers), hidden, residual)
        return hidden + residual


def load_into(params: dict, target: str, shard: int | None, tensor: torch.Tensor, name: str):
    """Copies checkpoint tensor `name` into parameter `target` (part `shard` of a fused one)."""
    if target not in params:
        raise ValueError(f"checkpoint tensor {name!r} matches no parameter")
    param = params[target]
    tensor = tensor.to(param.dtype)
    if shard is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard)


class LlamaForCausalLM(nn.Module):
    model_cls: type[nn.Module] = LlamaModel
    # checkpoint name part -> (fused parameter name part, shard index)
    fused_params = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @staticmethod
    def kv_cache_spec(config: ModelConfig) -> KVCacheSpec:
        """Keys and values of every KV head (of this rank's), per token and layer."""
        group = tp_group()
        heads = head_split(
            config.num_attention_heads, config.num_key_value_heads, group.size, group.rank
        )
        return KVCacheSpec(2, heads.num_kv, config.head_dim, heads.kv_start)

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, backend, max_positions)
        first_stage = pp_stage().first  # the head is where the sampling is
        self.lm_head = (
            ParallelLMHead(config.hidden_size, config.vocab_size, tp_group())
            if first_stage
            else OtherStage()
        )
        if config.tie_word_embeddings and first_stage:
            # (the lookup reads this W too, unless it decodes blocks: weights_from_blocks)
            self.lm_head.weight = self.model.embed_tokens.weight
        self._params: dict[str, nn.Parameter] | None = None  # by name, for shard_of
        # each matmul given GGUF blocks: the checkpoint tensors they came as
        self._block_names: dict[Linear, list[str]] = {}
        self._experts: ExpertTensors | None = None  # (also for shard_of)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, hidden=None):
        """Hidden states [T, hidden] of this step's tokens (before the final norm); of a
        pipeline stage, after its layers, from the previous stage's (`hidden`)."""
        return self.model(input_ids, positions, kv_caches, meta, hidden)

    def begin_layers(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> LayerPass:
        """A forward pass to run a few layers at a time (LlamaModel.begin_layers)."""
        return self.model.begin_layers(input_ids, positions, kv_caches, meta)

    def run_layers(self, layer_pass: LayerPass, num_layers: int) -> bool:
        return self.model.run_layers(layer_pass, num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the residual stream's dtype (16+ rows under bf16_prefill multiply in bf16)."""
        return self.lm_head(self.model.norm(hidden)).to(hidden.dtype)

    def pack_for_cpu(
        self, bf16_prefill: bool = False, weight_dtype: torch.dtype | None = None
    ) -> None:
        """Moves every matmul weight into oneDNN's layout, in `weight_dtype` if given, or in
        bf16 for `bf16_prefill` (see Linear.pack_for_cpu; a tied lm_head converts the
        embedding table with it)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu(bf16_prefill, weight_dtype)
            elif isinstance(module, Experts):
                module.pack_for_cpu(weight_dtype)
        self._params = None  # (a Linear may have let its fp32 weight go)
        if moved := gather_blocks(self):
            logger.info("GGUF blocks on 2 MB pages: %.0f MB", moved / 1e6)
        backend = self.model.local_layers[0].self_attn.backend
        fusable = not self.config.qk_norm and self.config.moe is None
        if isinstance(backend, CPUPagedBackend) and fusable:
            self.model.fused_decode = FusedDecode(self.model, backend.kernels)
        if bf16_prefill:  # decode batches of BF16_MIN_ROWS and more run in bf16 too,
            # but where every matmul has int8 tiles (up to DECODE_TILE_MAX_ROWS)
            fused = self.model.fused_decode
            on_tiles = fused is not None and fused.tiled
            self.model.fused_decode_max_rows = (
                DECODE_TILE_MAX_ROWS if on_tiles else BF16_MIN_ROWS - 1
            )

    def load_gguf_blocks(self, blocks: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hands each matmul the raw GGUF blocks of its weight (Hugging Face names, as
        from Checkpoint.gguf_blocks); call before pack_for_cpu, which decides on them."""
        linears = {name: m for name, m in self.named_modules() if isinstance(m, Linear)}
        experts = ExpertTensors(self)
        embedding = self.model.embed_tokens
        looks_up = isinstance(embedding, VocabParallelEmbedding)  # (the first stage's)
        for name, rows in blocks:
            if experts.load(name, rows, blocks=True):
                continue
            if name == "model.embed_tokens.weight" and looks_up:
                embedding.load_blocks(rows)  # (the lookup may decode its rows from them)
            if name == "model.embed_tokens.weight" and self.config.tie_word_embeddings:
                name = "lm_head.weight"  # the tied head multiplies by the embedding table
            target, shard = self._param_name(name)
            module = linears.get(target.removesuffix(".weight"))
            if module is not None:  # blocks of a non-matmul tensor are not used
                module.load_blocks(rows, shard)
                self._block_names.setdefault(module, []).append(name)

    def weights_from_blocks(
        self, kernels, bf16_prefill: bool, table_shared: bool = False
    ) -> set[str]:
        """After load_gguf_blocks: the checkpoint tensors not to read, since their matmuls
        will read only their blocks and a packed copy made from them (Linear.
        reads_only_blocks), and the lookup only its rows of blocks (VocabParallelEmbedding.
        read_blocks; not where a drafter reads the table, `table_shared`, nor a tied head
        that needs it, then `weight_shared`); those are marked to make it so."""
        embedding, head = self.model.embed_tokens, self.lm_head
        tied = self.config.tie_word_embeddings and isinstance(head, Linear)
        looks_up = isinstance(embedding, VocabParallelEmbedding)
        decodes = looks_up and embedding.blocks is not None and not table_shared
        if tied:  # W stays for both unless both read only blocks
            decodes = decodes and head.reads_only_blocks(kernels, bf16_prefill)
            head.weight_shared = head.weight_shared or not decodes
        names: set[str] = set()
        for module, parts in self._block_names.items():
            if module.reads_only_blocks(kernels, bf16_prefill):
                module.from_blocks = True
                names.update(parts)
        if decodes and embedding.read_blocks(kernels):
            names.add("model.embed_tokens.weight")
            if tied:  # one placeholder for both, as the tie had one table
                head.weight = embedding.weight
        elif looks_up:  # (a tied head keeps its own blocks)
            embedding.blocks = None
        return names

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], from_blocks: Set[str] = frozenset()
    ) -> None:
        """Copies checkpoint tensors (Hugging Face names) into the parameters; those in
        `from_blocks` (weights_from_blocks) come as placeholders and stay unread."""
        params = dict(self.named_parameters())
        experts = ExpertTensors(self)
        loaded: set[str] = set()
        for name, tensor in weights:
            if name in from_blocks:
                loaded.add(name)
                continue
            name = self._checkpoint_name(name)
            if name is None or not self.model.holds(name) or experts.load(name, tensor):
                continue
            load_into(params, *self._param_name(name), tensor, name)
            loaded.add(name)
        self._check_complete(params, loaded | experts.complete())

    def shard_of(self, name: str) -> tuple[int, int, int] | None:
        """The part (dim, start, length) of checkpoint tensor `name` this rank holds under
        tensor parallelism; None: the whole tensor (or one not loaded)."""
        name = self._checkpoint_name(name)
        if name is None:
            return None
        if not self.model.holds(name):  # another pipeline stage's
            return SKIP
        if self._params is None:
            self._params = dict(self.named_parameters())
        if self._experts is None:
            self._experts = ExpertTensors(self)
        expert = self._experts.expert_of(name)
        if expert is not None:  # nothing of an expert another rank holds (expert parallel)
            layer, index, part = expert
            return layer.shard_of_expert(index, part)
        return shard_of(self._params, *self._param_name(name))

    def _checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as this model's parameters go; None: not loaded."""
        if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return None
        return name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for it

    def _param_name(self, name: str) -> tuple[str, int | None]:
        for part, (fused, shard) in self.fused_params.items():
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard
        return name, None

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        covered = {self._param_name(n)[0] for n in loaded}
        missing = sorted(set(params) - covered)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


class MixtralForCausalLM(LlamaForCausalLM):
    pass


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    pass
