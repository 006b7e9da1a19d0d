"""Building blocks shared by the model files: norms, fused linears (rotary embedding:
rotary.py).

Parameters are created with `torch.empty` (no init cost) and filled by the loader
through each parameter's `weight_loader(param, tensor, shard_id)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.engine.padded_rows import ROW_QUANTUM, padded_rows
from ember.models import huge_pages
from ember.models.tiles import tile_blocks, tiles_apply


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"weight shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
    param.data.copy_(tensor)


def new_param(*shape: int) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = default_weight_loader
    return param


def cpu_kernels_for(x: torch.Tensor):
    """ember's fused C++ kernels when they apply to x (float32 on CPU), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    from ember.engine.kernels import cpu_kernels

    return cpu_kernels()


class RMSNorm(nn.Module):
    """RMS norm; given a residual, it first adds x to it (in place where fused) and returns
    (normed, residual): transformers' `hidden = residual + x; norm(hidden)`."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = new_param(hidden_size)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, low_out=False):
        """`low_out`: where x comes in bf16 to a float32 residual (a bf16 step: a bf16
        matmul's output), the norm goes out in bf16 too, for the bf16 matmul next: on CPU
        the fused kernel widens x, adds, normalizes in float32 and rounds once, exactly the
        float32 norm rounded as that matmul would round it, without two conversions."""
        if residual is not None and x.dtype != residual.dtype:
            kernels = cpu_kernels_for(residual) if x.dim() == 2 else None
            fused = kernels is not None and x.dtype == torch.bfloat16
            if fused and self.weight.dtype == torch.float32:
                out = kernels.add_rms_norm(residual, x, self.weight, self.eps, low_out)
                return out, residual
            x = x.to(residual.dtype)  # a bf16 matmul's output joins the fp32 residual stream
        kernels = cpu_kernels_for(x) if x.dim() == 2 else None
        if residual is None:
            if kernels is not None:
                return kernels.add_rms_norm(x, None, self.weight, self.eps)
            return self._norm(x)
        if kernels is not None:
            return kernels.add_rms_norm(residual, x, self.weight, self.eps), residual
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Linear(nn.Module):
    """y = x W^T (+ b); W is [out_features, in_features] like Hugging Face's.

    On CPU, `pack_for_cpu()` (called once after loading) picks the matmul by batch rows:
    - up to BLOCK_GEMM_MAX_ROWS, when W came from a GGUF file's blocks in one of the
      loader's BLOCK_FORMATS (`load_blocks`): ember's block GEMM, which decodes those
      blocks in registers to exactly the fp32 W (bit-identical results, 4-7x fewer bytes
      streamed per step); with int8 decode activations (`int8_max_rows`), its int8 GEMM,
      on Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks regrouped into tiles of 16 features
      (`tile_blocks`);
    - up to SMALL_GEMM_MAX_ROWS (decode): ember's small GEMM (the CPU's vector build of
      it), which streams W once (measured: 18% faster than oneDNN at 4 rows, 8% faster
      than MKL at 1);
    - PACKED_MIN_ROWS and up (prefill): oneDNN on a packed copy of W, which costs W's
      size again; MKL's GEMM re-packs W on every call;
    - otherwise, and off CPU: F.linear. The C++ decode layer makes the same choice.
    With int8 activations on every row (`use_int8_activations(model, every_row=True)`,
    matmul_precision int8), a W whose blocks tile takes every row count on its tiles:
    prefill chunks multiply as decode steps do, and no packed copy is made.
    With `bf16_prefill` (CPUs with AMX or AVX-512 BF16), the packed copy is W in bf16
    instead, made once, and every matmul of BF16_MIN_ROWS rows and more (prefill, large
    decode batches) multiplies bf16 x by it and returns bf16 y, which the model carries
    into the next op; fewer rows keep the choices above on the fp32 W (or its blocks),
    with F.linear where they took the packed copy (no fp32 one is kept).
    A W whose blocks take every row count the packed copy does not (`reads_only_blocks`)
    is not kept in fp32 at all: it is not even read from the file (`from_blocks`, the
    packed copy made from the blocks), or goes once packed.
    With `weight_dtype=torch.bfloat16` W itself is stored in bf16 (half the bytes every
    decode step streams) while x and y stay fp32: the small GEMM widens W in registers
    (x exact), larger batches round x to bf16 for oneDNN and widen its bf16 result.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = new_param(out_features, in_features)
        self.bias = new_param(out_features) if bias else None
        self.packed: torch.Tensor | None = None
        self.small_gemm = None  # ember's kernel for 1-8 rows, when it applies
        self.bf16_prefill = False  # rows >= BF16_MIN_ROWS: bf16 x, bf16 `packed`, bf16 y
        # ember's kernel running the bf16 packed matmul on row ranges at once, a thread
        # each: where `split_by_rows` (measured on this CPU by SplitTuner; by rows //
        # ROW_QUANTUM) says it wins; before it is measured, where split_apply does
        self.split_rows = None
        self.split_by_rows: tuple[bool, ...] | None = None
        self.split_default = False
        # W as GGUF blocks, uint8 [out_features, blocks per row, bytes per block]; a fused
        # W whose parts came in different formats keeps each part's blocks (`block_parts`,
        # in order along out_features) and multiplies them one by one
        self.blocks: torch.Tensor | None = None
        self.block_parts: list[torch.Tensor] = []
        self.block_gemm = None  # ember's kernel over `blocks`, when it applies
        self.block_max_rows = BLOCK_GEMM_MAX_ROWS  # the most rows it takes (tiles: all)
        # up to this many rows multiply `blocks` with int8 activations (`int8_gemm`); set
        # before pack_for_cpu, which keeps it only where the blocks are kept, and tiles
        # 32-weight blocks for it (tile_blocks: [out / 16, blocks, 16, bytes])
        self.int8_max_rows = 0
        self.int8_gemm = None
        self._block_parts: dict[int, torch.Tensor] = {}
        # other code reads W itself (a tied embedding table, MLA's absorbed kv_b_proj):
        # pack_for_cpu keeps it whatever the matmuls read
        self.weight_shared = False
        # W was left unread at load, to be made from the blocks (reads_only_blocks)
        self.from_blocks = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.bf16_prefill and rows >= BF16_MIN_ROWS:
            return self._packed_linear(x.to(torch.bfloat16))  # bf16 out, for the next op
        if self.block_gemm is not None and rows <= self.block_max_rows:
            gemm = self.int8_gemm if rows <= self.int8_max_rows else self.block_gemm
            if self.blocks is not None:
                return gemm(x, self.blocks, self.bias)
            y = torch.cat([gemm(x, part, None) for part in self.block_parts], dim=1)
            return y if self.bias is None else y.add_(self.bias)
        if self.small_gemm is not None and rows <= SMALL_GEMM_MAX_ROWS:
            return self.small_gemm(x.contiguous(), self.weight, self.bias)
        if self.weight.dtype != x.dtype:  # bf16 weights under fp32 activations
            return self._mixed_linear(x)
        if self.packed is not None and self.packed.dtype == x.dtype and rows >= PACKED_MIN_ROWS:
            return self._packed_linear(x)
        return F.linear(x, self.weight, self.bias)

    def rounds_input(self, rows: int) -> bool:
        """Whether forward on `rows` rows rounds x first: to bf16 (bf16 prefill) or to
        int8 per 32 values (int8 activations)."""
        if self.bf16_prefill and rows >= BF16_MIN_ROWS:
            return True
        return (
            self.block_gemm is not None
            and self.int8_gemm is not None
            and rows <= min(self.block_max_rows, self.int8_max_rows)
        )

    def _packed_linear(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        x = padded_rows(x)  # oneDNN's primitives by row count: fewer counts, made once
        parts = self.split_parts(x.shape[0])
        if parts > 1:
            y = self.split_rows(x, self.packed, self.bias, parts)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y if y.shape[0] == rows else y[:rows]

    def split_parts(self, rows: int) -> int:
        """The row ranges a bf16 matmul of `rows` (padded) rows runs in, a thread each; 1:
        whole, oneDNN threading it."""
        parts = split_ranges(rows) if self.split_rows is not None else 1
        if parts < 2:
            return 1
        table = self.split_by_rows
        if table is None:
            return parts if self.split_default else 1
        return parts if table[min(rows // ROW_QUANTUM, len(table) - 1)] else 1

    def _mixed_linear(self, x: torch.Tensor) -> torch.Tensor:
        low = x.to(self.weight.dtype)
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(low, self.packed, None, "none", [], "")
        else:
            y = F.linear(low, self.weight)
        y = y.to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)

    def load_blocks(self, rows: torch.Tensor, shard_id: int | None = None) -> None:
        """The checkpoint's raw blocks of W (or of part `shard_id` of a merged W): uint8
        [rows, blocks per row, bytes per block], a row per output feature. Used once every
        part has come: as one matrix in one format, else part by part."""
        sizes = getattr(self, "output_sizes", [self.weight.shape[0]])
        shard = shard_id or 0
        rows = self._rank_blocks(rows, shard)
        if rows.dim() != 3 or rows.dtype != torch.uint8 or rows.shape[0] != sizes[shard]:
            raise ValueError(
                f"blocks of shape {tuple(rows.shape)} ({rows.dtype}) do not fit "
                f"{sizes[shard]} rows of this weight"
            )
        self._block_parts[shard] = rows
        if len(self._block_parts) == len(sizes):
            parts = [self._block_parts[i] for i in range(len(sizes))]
            if len({part.shape[1:] for part in parts}) == 1:  # one format throughout
                self.blocks = torch.cat(parts) if len(parts) > 1 else parts[0]
            else:
                self.block_parts = parts
            self._block_parts = {}

    @property
    def block_list(self) -> list[torch.Tensor]:
        """W's blocks as the kernels take them: [blocks], the parts' blocks, or []."""
        return [self.blocks] if self.blocks is not None else self.block_parts

    def _rank_blocks(self, rows: torch.Tensor, shard: int) -> torch.Tensor:
        """A tensor-parallel rank's rows of a matrix's blocks (given all of them, or only
        its own); a rank's columns come narrowed by the loader (Checkpoint.gguf_blocks)."""
        part = getattr(self.weight, "shard_of", lambda shard: None)(shard)
        if part is None or part[0] != 0 or rows.shape[0] == part[2]:
            return rows
        return rows.narrow(0, part[1], part[2])

    def pack_for_cpu(
        self, bf16_prefill: bool = False, weight_dtype: torch.dtype | None = None
    ) -> None:
        from ember.engine.kernels import cpu_kernels

        kernels = cpu_kernels()  # x is fp32 on CPU (can_pack_for_cpu); W fp32 or bf16
        if weight_dtype is not None and weight_dtype != self.weight.dtype:
            self.weight.data = self.weight.data.to(weight_dtype)
        self.bf16_prefill = bf16_prefill
        packed_dtype = torch.bfloat16 if bf16_prefill else self.weight.dtype
        only_blocks = self.reads_only_blocks(kernels, bf16_prefill)
        if self.from_blocks and not only_blocks:  # W was never read: it must not be used
            raise RuntimeError("a weight left unread for its blocks is needed after all")
        every_row = self.tiles_take_every_row(kernels)
        if not every_row:
            self.packed = self._packed_copy(kernels, packed_dtype)
        out_features, in_features = self.weight.shape
        split = bf16_prefill and kernels is not None and self.packed is not None
        self.split_rows = kernels.linear_split_rows if split else None
        self.split_default = split and split_apply(out_features, in_features)
        self.split_by_rows = None
        small = kernels is not None and kernels.small_gemm_supported(1, in_features, out_features)
        if small and not only_blocks:
            self.small_gemm = kernels.small_gemm
        # the blocks decode to the fp32 W; a model converted to another dtype drops them
        if self._blocks_apply(kernels):
            self.block_gemm = kernels.block_gemm
            if self.int8_max_rows and tiles_apply(self.block_list):
                # int8 on tiles pays at every row count the blocks take (int8_rows), so
                # the plain layout is not read again: the tiles replace it
                parts = [tile_blocks(part, kernels) for part in self.block_list]
                if self.blocks is not None:
                    self.blocks = parts[0]
                else:
                    self.block_parts = parts
            self.int8_max_rows = min(self.int8_max_rows, int8_rows(self.block_list, every_row))
            self.int8_gemm = kernels.block_gemm_int8 if self.int8_max_rows else None
            if every_row:
                self.block_max_rows = self.int8_max_rows
        else:
            self.blocks, self.block_parts = None, []
            self.int8_max_rows = 0
        if only_blocks:  # its shape stays, on the meta device, so that a read of it fails loudly
            self.weight = meta_param(self.weight)

    def _packed_copy(self, kernels, dtype: torch.dtype) -> torch.Tensor:
        """W in oneDNN's layout, in `dtype` (in bf16 mode the only packed copy: no fp32 one
        is kept). Where W was not read from the checkpoint, its blocks alone serving
        (from_blocks), it is made from them, exactly the fp32 W (bf16: decoded straight to
        it, rounded as torch rounds)."""
        if self.from_blocks:
            source = self._decoded_blocks(kernels, dtype == torch.bfloat16)
        else:
            source = self.weight.detach()
        return torch.ops.mkldnn._reorder_linear_weight(source.to(dtype), 16)

    def tiles_take_every_row(self, kernels) -> bool:
        """Whether W's blocks will be int8 tiles that every row count multiplies (int8
        activations on every row asked, `int8_max_rows` past BLOCK_GEMM_MAX_ROWS, and
        blocks that tile): then no packed copy is made. Known from the blocks' shapes,
        before packing."""
        return (
            self.int8_max_rows > BLOCK_GEMM_MAX_ROWS
            and self._blocks_apply(kernels)
            and tiles_apply(self.block_list)
        )

    def _blocks_apply(self, kernels) -> bool:
        """Whether the block GEMM takes every part of W's blocks (fp32 W, shapes it takes)."""
        parts, (_, in_features) = self.block_list, self.weight.shape
        return (
            bool(parts)
            and kernels is not None
            and self.weight.dtype == torch.float32
            and all(
                kernels.block_gemm_supported(in_features, p.shape[0], p.shape[2]) for p in parts
            )
        )

    def reads_only_blocks(self, kernels, bf16_prefill: bool) -> bool:
        """Whether, once packed, no matmul reads the fp32 W: its blocks take up to
        BLOCK_GEMM_MAX_ROWS rows and the packed copy the rest (from BF16_MIN_ROWS, or
        PACKED_MIN_ROWS in fp32), or its tiles take every row (tiles_take_every_row), and
        no other code reads W (`weight_shared`). Such a W goes after packing (4 bytes a
        weight), and need not be read from the checkpoint at all (`from_blocks`). Call
        once the blocks are loaded."""
        packed_from = BF16_MIN_ROWS if bf16_prefill else PACKED_MIN_ROWS
        return (
            not self.weight_shared
            and packed_from <= BLOCK_GEMM_MAX_ROWS + 1
            and self._blocks_apply(kernels)
        )

    def _decoded_blocks(self, kernels, bf16: bool = False) -> torch.Tensor:
        """The fp32 W its blocks decode to (parts in order along out_features), or with
        `bf16` that W rounded to bf16 (in the decoder's one pass)."""
        parts = [kernels.dequantize_blocks(part, bf16) for part in self.block_list]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


EVERY_ROW = 1 << 30  # a row limit no step reaches


def use_int8_activations(model: nn.Module, every_row: bool = False) -> None:
    """Every matmul of `model` multiplies its GGUF blocks on int8 activations in steps of up
    to int8_rows(its blocks) rows (decode_activations int8); with `every_row`
    (matmul_precision int8) a matmul whose blocks tile does so at every row count, prefill
    chunks included, and keeps no packed copy. Call before pack_for_cpu, and on a planning
    copy before planned_weight_bytes (which then counts no packed copy for it)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.int8_max_rows = EVERY_ROW if every_row else BLOCK_GEMM_MAX_ROWS


def tiled(linear: Linear) -> bool:
    """Whether `linear` multiplies int8 tiles (tile_blocks), which take every row count."""
    parts = linear.block_list
    return linear.int8_gemm is not None and bool(parts) and all(p.dim() == 4 for p in parts)


def int8_rows(parts: list[torch.Tensor], every_row: bool = False) -> int:
    """The most rows that multiply blocks in these formats faster on int8 activations
    (the fewest of the parts'; tiles take every row count: BLOCK_GEMM_MAX_ROWS, or
    EVERY_ROW with `every_row`; 1 for formats not in INT8_ROWS)."""
    if not parts:
        return 1
    on_tiles = EVERY_ROW if every_row else BLOCK_GEMM_MAX_ROWS
    return min(on_tiles if p.dim() == 4 else INT8_ROWS.get(p.shape[2], 1) for p in parts)


def meta_param(weight: torch.Tensor) -> nn.Parameter:
    """A placeholder of `weight`'s shape and dtype on the meta device. (torch.empty, not
    empty_like: of a tensor already there, that goes through torch's Python references,
    whose first use imports sympy, 0.3 s of a start.)"""
    return nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), False)


def planned_weight_bytes(model: nn.Module, kernels, packed_itemsize: int) -> int:
    """The bytes `model`'s weights will hold once loaded and packed (pack_for_cpu), from
    shapes alone, so that a copy on the meta device with its GGUF blocks given as meta
    tensors tells it: each parameter once, less the W of a matmul marked `from_blocks`;
    each matmul's packed copy (`packed_itemsize` bytes a weight; 0: none); the GGUF blocks
    the block GEMM will read (MoE experts': all that came)."""
    seen: set[int] = set()
    total, block_sizes = 0, []
    as_read: set[int] = set()  # block tensors a matmul keeps as they came (not moved, not tiled)
    lookups = []  # embeddings that decode their rows of blocks
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            skipped = getattr(module, "from_blocks", False) and name == "weight"
            if id(param) not in seen and not skipped:
                seen.add(id(param))
                total += param.numel() * param.element_size()
        if isinstance(module, Linear):
            if not module.tiles_take_every_row(kernels):
                total += module.weight.numel() * packed_itemsize
            if module._blocks_apply(kernels):
                block_sizes += [part.numel() for part in module.block_list]
                tiled = module.int8_max_rows and tiles_apply(module.block_list)
                if not huge_pages.applies() and not tiled:
                    as_read.update(id(part) for part in module.block_list)
        elif getattr(module, "from_blocks", False):  # an embedding (VocabParallelEmbedding)
            lookups.append(module)
        elif hasattr(module, "loaded_block_bytes"):  # MoE experts (Experts)
            total += module.loaded_block_bytes()
    # a tied head's blocks are the lookup's own, unless the head tiles or moves them
    total += sum(m.loaded_block_bytes() for m in lookups if id(m.blocks) not in as_read)
    # the matmuls' blocks end in one mapping on huge pages (gather_blocks), counted whole
    return total + (
        huge_pages.mapping_bytes(block_sizes) if huge_pages.applies() else sum(block_sizes)
    )


def block_decode_summary(model: nn.Module) -> str | None:
    """A line for the log on the matmuls that read GGUF blocks in decode (None if none)."""
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.block_gemm is not None]
    if not linears:
        return None
    megabytes = sum(part.numel() for m in linears for part in m.block_list) / 1e6
    int8 = sorted({m.int8_max_rows for m in linears} - {0})
    summary = (
        f"decode steps read the GGUF file's blocks for {len(linears)} matmuls "
        f"({megabytes:.0f} MB per step)"
    )
    if not int8:
        return summary
    rows = f"{int8[0]}" if len(int8) == 1 else f"{int8[0]}-{int8[-1]} (by format)"
    return summary + f", with int8 activations in steps of up to {rows} row(s)"


PACKED_MIN_ROWS = 3  # measured: 2 rows run faster on MKL, 4 on oneDNN
# measured on SmolLM2's Q4_1 weights, one pass: ember's block GEMM 3.5x (1 row) to 1.8x
# (8 rows) faster than its fp32 small GEMM, 1.5x faster than oneDNN at 16 rows, level by
# 32 (from 8 rows on it is compute-bound, and it reads W again for every 8 rows)
BLOCK_GEMM_MAX_ROWS = 16
# decode-only steps (the fused decode layer) read the blocks up to this many rows where
# a packed fp32 copy would take the rest: in the model, where both stream from memory,
# the blocks still win past 16 (SmolLM2's Q4_1 file, ieee, 2 threads, ms a decode step,
# oneDNN -> blocks: 17 sequences 49-50 -> 40, 24: 57-58 -> 48, 32: 66 -> 62, 48: 90 -> 88)
DECODE_BLOCK_MAX_ROWS = 32
SMALL_GEMM_MAX_ROWS = 8  # ember's small GEMM beats both up to here (decode batches)
# decode_activations int8: blocks that are not tiled (the K-quants; the 32-weight formats
# where out_features is not a multiple of 16) multiply on int8 activations up to this
# many rows, by format (bytes per block). Measured
# (benchmarks/int8_gemm.py, AMD EPYC, 2 threads, SmolLM2's shapes, blocks from memory;
# int8 / fp32 speed at 1, 2, 3, 4, 6 rows): Q4_1 1.1x, 1.0-1.1x, 0.8-1.2x, 0.7-0.8x;
# Q5_0 1.6x, 1.25x, 1.0-1.1x, 0.9-1.0x; Q4_K 2.6x, 2.0x, 1.6x, 1.35x, 1.1x; Q6_K 2.8x,
# 1.25x, 1.25x, 1.15x, 0.8x. Each further row pays a float conversion and scale per 32
# products, where the fp32 path shares one decoded vector among its rows. Tiles take
# every row count the blocks do (1.6-3.2x the fp32 path at 1-16 rows on Q4_1).
INT8_ROWS = {18: 1, 20: 1, 34: 1, 22: 2, 24: 2, 144: 4, 176: 4, 210: 4}
# bf16_prefill: from here on the bf16 packed copy runs 2.3x (16 rows) to 4x (64 rows)
# faster than oneDNN's fp32 (SmolLM2's layer, 1 thread); fewer rows stay exact
BF16_MIN_ROWS = 16
# bf16_prefill: decode-only steps of up to this many sequences stay on the int8 tiles
# (the fused decode layer) where every matmul has them, as steps of fewer do: they
# stream SmolLM2's 60 MB of tiles a step where its bf16 copies are 213 MB. Measured
# (AMX Xeon, 2 threads, ms a decode step, bf16 -> tiles): 16 sequences 29-31 -> 18-19,
# 32: 39-42 -> 29-30, 48: 44-46 -> 40, 56: 49-50 -> 46-49, 64: 49-52 -> 55
DECODE_TILE_MAX_ROWS = 48


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(f.read().split())
    except OSError:
        return set()


# On a CPU with AMX, oneDNN runs a bf16 matmul with a narrow output from a wide input on
# one thread at prefill sizes (SmolLM2's down_proj, 1,536 -> 576: 512 rows as fast on two
# threads as on one); ember's kernel then runs row ranges of at least this many rows at
# once, one thread each (docs/benchmarks.md, `benchmarks/matmul_rows.py`: 224 rows 0.240
# -> 0.180 ms, 512 rows 0.554 -> 0.355). Below 224 rows oneDNN threads it well and the
# split loses (128 rows 0.093 against 0.135 ms), hence ranges of 112+. A square 576 x 576
# matmul goes to one thread from 352 rows (0.144 -> 0.117 split) but not before: left
# whole. With more threads oneDNN threads the shape itself and the split loses at every
# row count: on a 16-core AMX Xeon (`benchmarks/split_threads.py`), down_proj at 512 rows
# whole / split took 0.34 / 1.08 ms on 8 threads and 0.28 / 1.22 ms on 16, and a whole
# 512-token prefill 55-82 ms whole against 108-117 split. So it splits on two threads
# (or one, where there is nothing to split), never more.
SPLIT_MIN_PART_ROWS = 112
SPLIT_MAX_THREADS = 2
# Nor is that rule the whole story: on the same Xeon, on two threads, whole against split
# (ms per 1,000 rows): the 960 x 576 qkv 0.68-0.91 / 0.50-0.60 at 384-1,024 rows but 0.41
# / 0.52 from 1,280; the 576 x 576 o_proj 0.46-0.49 / 0.31-0.37 at 384-768 but 0.23 /
# 0.29 from 1,024; down_proj 1.33-1.65 / 0.71-0.88 up to 1,280 but 0.74-0.78 / 0.79-0.82
# from 1,536 (docs/benchmarks.md). Which wins moves with the shape, the row count and the
# CPU, so the engine measures it (ember.engine.matmul_split) per shape and row count
SPLIT_MAX_OUT, SPLIT_MIN_IN = 1024, 1024


def split_ranges(rows: int) -> int:
    """The row ranges a split matmul of `rows` rows runs in: a thread each, of
    SPLIT_MIN_PART_ROWS rows or more; 1 (no split) off two threads."""
    threads = torch.get_num_threads()
    return min(threads, rows // SPLIT_MIN_PART_ROWS) if 1 < threads <= SPLIT_MAX_THREADS else 1


def split_apply(out_features: int, in_features: int) -> bool:
    """Whether a bf16 packed matmul of this shape runs split by rows (split_rows)."""
    return out_features <= SPLIT_MAX_OUT and in_features >= SPLIT_MIN_IN and cpu_has_amx()


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles for bf16 (Intel Sapphire Rapids and later)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return probe() if probe is not None else "amx_bf16" in _cpu_flags()


def cpu_bf16_outruns_fp32() -> bool:
    """Whether this CPU's bf16 matmuls are faster than its fp32 ones: AMX tiles, or
    AVX-512 BF16 on AMD (Zen 4 and later), measured 3.8-4.1x and 1.6x faster at prefill.
    An Intel CPU with AVX-512 BF16 and no AMX (Cooper Lake; a Xeon whose hypervisor hides
    AMX) runs oneDNN's bf16 matmuls 1.7x slower than its fp32 ones (docs/benchmarks.md)."""
    return cpu_has_amx() or (cpu_has_bf16() and "AuthenticAMD" in _cpu_flags())


def cpu_int8_outruns_fp32(kernels) -> bool:
    """Whether the int8 tiles' GEMM outruns oneDNN's fp32 one at prefill sizes: where its
    sums run on AVX512-VNNI (1.6-2.3x at 128-512 rows on an Intel Xeon). Not on AVX2's
    maddubs (0.8-1.1x), nor on the AVX2 build's AVX-VNNI (0.9-1.0x at 128-512 rows on an
    AMD EPYC, Zen 5; docs/benchmarks.md), which serve decode steps' few rows."""
    return kernels is not None and kernels.tiles_vnni_name() == "avx512vnni"


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX or AVX-512 BF16); elsewhere oneDNN
    emulates bf16, slower than fp32."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    found = [getattr(torch.cpu, name, None) for name in probes]
    if all(probe is not None for probe in found):
        return any(probe() for probe in found)
    return bool(_cpu_flags() & {"amx_bf16", "avx512_bf16"})


def can_pack_for_cpu(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model with activations of `dtype` takes the CPU matmul choices above."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class MergedLinear(Linear):
    """Several projections of one input fused into one matmul (QKV, gate/up).

    Checkpoints store the parts separately; `weight_loader` copies part `shard_id`
    (an index into `output_sizes`) into its rows. With `slices` (tensor parallel: a
    (start, length) per part), the layer holds rows [start, start + length) of each part
    of `output_sizes` rows, and each parameter's `shard_of(shard_id)` says so.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        slices: list[tuple[int, int]] | None = None,
    ) -> None:
        self.full_sizes = output_sizes
        self.slices = slices or [(0, size) for size in output_sizes]
        output_sizes = [length for _, length in self.slices]
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self._load_shard
                param.shard_of = self._shard_of

    def _shard_of(self, shard_id: int) -> tuple[int, int, int] | None:
        start, length = self.slices[shard_id]
        return None if length == self.full_sizes[shard_id] else (0, start, length)

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: int) -> None:
        start = sum(self.output_sizes[:shard_id])
        rows = param.data.narrow(0, start, self.output_sizes[shard_id])
        part = self._shard_of(shard_id)
        if part is not None and tensor.shape[0] == self.full_sizes[shard_id]:
            tensor = tensor.narrow(0, part[1], part[2])  # read whole: this rank's rows
        default_weight_loader(rows, tensor)


def silu_and_mul(gate_up: torch.Tensor, approx_exp: bool = False) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2I]: ember's one fused pass on CPU, in fp32 and in bf16
    (a bf16 step's MLP), else torch's two ops. `approx_exp`: the result will be rounded to
    int8 or bf16, so the fp32 pass may take e^-|g| to within 3e-6 (a bf16 pass always does)."""
    kernels = None
    if gate_up.device.type == "cpu" and gate_up.dtype in (torch.float32, torch.bfloat16):
        from ember.engine.kernels import cpu_kernels

        kernels = cpu_kernels() if gate_up.dim() == 2 and gate_up.stride(-1) == 1 else None
    if kernels is not None:
        return kernels.silu_and_mul(gate_up, approx_exp)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
