"""Mixture-of-experts layers: the router that picks each token's experts, and the
experts, run grouped (every expert's matmuls once over the tokens routed to it).

Expert weights are stacked as transformers holds them in memory: `gate_up_proj`
[experts, 2 x intermediate, hidden] and `down_proj` [experts, hidden, intermediate];
`load_expert` takes the per-expert tensors that published checkpoints (and
transformers' save_pretrained) write, `experts.{e}.gate_proj.weight` and the like.
"""

from __future__ import annotations

import re
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed.parallel import SKIP, expert_group, split
from ember.model_config import MoEConfig
from ember.models.layers import (
    BLOCK_GEMM_MAX_ROWS,
    SMALL_GEMM_MAX_ROWS,
    default_weight_loader,
    new_param,
    silu_and_mul,
)
from ember.models.parallel_layers import narrowed


class TopKRouter(nn.Module):
    """Each token's `top_k` experts and their weights, in fp32 like transformers.

    - "sigmoid" scoring (DeepSeek-V3, Kimi K2): sigmoid scores; the selection adds
      `e_score_correction_bias` (it steers the choice, never the weights); experts come
      in `num_groups` groups ranked by the sum of their two best biased scores, and a
      token chooses among the `topk_groups` best groups only; the chosen experts' plain
      scores, normalized to sum 1 if `norm_topk_prob`, times `routed_scaling_factor`;
    - "softmax" scoring (Mixtral, Qwen3-MoE): softmax over all experts, the top_k
      largest, renormalized if `norm_topk_prob`.
    Ties go as torch.topk breaks them, the same calls as transformers makes.
    """

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = new_param(moe.num_experts, hidden_size)
        self.e_score_correction_bias = (
            new_param(moe.num_experts) if moe.scoring == "sigmoid" else None
        )

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] fp32, expert ids [T, top_k])."""
        moe = self.moe
        logits = F.linear(hidden.float(), self.weight.float())
        if moe.scoring == "softmax":
            probs = torch.softmax(logits, dim=-1)
            weights, ids = torch.topk(probs, moe.top_k, dim=-1)
            if moe.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights, ids
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if moe.num_groups > 1:
            grouped = choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            best = torch.topk(group_scores, k=moe.topk_groups, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
            keep = keep.unsqueeze(-1).expand_as(grouped).reshape(-1, moe.num_experts)
            choice = choice.masked_fill(~keep, float("-inf"))
        ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, ids


# torch's grouped GEMM: one kernel for every expert's matmul (CUTLASS on Hopper and
# Blackwell for bf16; elsewhere torch loops over the groups itself)
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
EXPERT_MODES = ("auto", "grouped", "loop")


class Experts(nn.Module):
    """The routed experts of one layer (SwiGLU MLPs), run grouped by expert.

    On CUDA every expert's gate/up matmul is one grouped GEMM over the tokens sorted by
    expert, and so is every expert's down matmul (`GROUPED_MM`): two kernels a layer, no
    loop over experts in Python and no wait for the tokens' counts. Elsewhere (and on
    CUDA where the weights' rows are not 16-byte aligned, as torch's kernel asks) a loop
    runs each expert's matmuls once over its tokens; `mode` forces either.

    On CPU an expert's matmul over its few rows of a decode step (fp32 weights) reads the
    GGUF file's blocks of its weights where the file had them in a block format
    (`load_blocks`: ember's block GEMM, bit-identical to the fp32 weights, 4-7x fewer
    bytes), else streams the weights once through ember's small GEMM.

    Over several ranks every rank routes every token (the hidden states are the same on
    all), runs its share of the experts' work, and the shares are summed over the ranks
    (by the caller, `SparseMoE`, with the shared expert's share: one all-reduce):
    - expert parallel (a group with `expert_parallel`): this rank holds whole experts
      [first, first + num_local) only;
    - else (tensor parallel within each expert, as vLLM does by default): this rank holds
      every expert's intermediate features [inter_start, inter_start + inter_size), the
      rows of gate and up and the columns of down that go with them.
    """

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.num_experts = moe.num_experts
        self.intermediate_size = moe.intermediate_size
        self.group = group = expert_group()
        by_expert = group.expert_parallel or group.size == 1
        self.first, self.num_local = split(moe.num_experts, group.size, group.rank)
        self.inter_start, self.inter_size = 0, moe.intermediate_size
        if not by_expert:
            self.first, self.num_local = 0, moe.num_experts
            self.inter_start, self.inter_size = split(moe.intermediate_size, group.size, group.rank)
        size = self.inter_size
        self.gate_up_proj = new_param(self.num_local, 2 * size, hidden_size)
        self.down_proj = new_param(self.num_local, hidden_size, size)
        for param in (self.gate_up_proj, self.down_proj):
            param.weight_loader = self._load_stacked
        self.gate_up_proj.shard_of = lambda shard_id=None: self._stacked_part("gate_up_proj")
        self.down_proj.shard_of = lambda shard_id=None: self._stacked_part("down_proj")
        self.mode = "auto"  # EXPERT_MODES: grouped GEMM on CUDA, a loop elsewhere
        self.small_gemm = None  # ember's kernel for an expert's few rows (pack_for_cpu)
        # GGUF blocks of the stacked weights, uint8 [experts, out, blocks per row, bytes
        # per block] (pack_for_cpu keeps them where ember's block GEMM takes them)
        self.blocks: dict[str, torch.Tensor | None] = {"gate_up_proj": None, "down_proj": None}
        self.block_gemm = None
        self._block_parts: dict[tuple[str, int], torch.Tensor] = {}
        # the rank that holds each expert
        owner = [
            r for r in range(group.size) for _ in range(split(self.num_experts, group.size, r)[1])
        ]
        self.register_buffer(
            "owner",
            torch.tensor(owner if by_expert else [0] * self.num_experts, dtype=torch.long),
            persistent=False,
        )
        # tokens routed to each expert since start (expert-load statistics)
        self.register_buffer(
            "tokens_per_expert", torch.zeros(moe.num_experts, dtype=torch.long), persistent=False
        )

    def pack_for_cpu(self, weight_dtype: torch.dtype | None = None) -> None:
        """Called once after loading, on CPU with fp32 activations (like Linear's): the
        weights in `weight_dtype` if given (bfloat16: half the bytes a step reads), and
        ember's small GEMM for experts with few tokens, where the shapes suit it (it reads
        W once; MKL's GEMM packs it first), or its block GEMM where the blocks came."""
        if weight_dtype is not None:
            self.gate_up_proj.data = self.gate_up_proj.data.to(weight_dtype)
            self.down_proj.data = self.down_proj.data.to(weight_dtype)
        from ember.engine.kernels import cpu_kernels

        kernels = cpu_kernels()
        hidden, size = self.down_proj.shape[1:]
        shapes = {"gate_up_proj": (hidden, 2 * size), "down_proj": (size, hidden)}
        fits = kernels is not None and all(
            kernels.small_gemm_supported(1, n_in, n_out) for n_in, n_out in shapes.values()
        )
        self.small_gemm = kernels.small_gemm if fits else None
        for name, (n_in, n_out) in shapes.items():
            blocks = self._stacked_blocks(name)
            usable = (
                blocks is not None
                and kernels is not None
                and self.gate_up_proj.dtype == torch.float32  # the blocks decode to fp32 W
                and kernels.block_gemm_supported(n_in, n_out, blocks.shape[3])
            )
            self.blocks[name] = blocks if usable else None
        self._block_parts = {}
        has_blocks = any(blocks is not None for blocks in self.blocks.values())
        self.block_gemm = kernels.block_gemm if has_blocks else None

    def shard_of_expert(self, expert: int, part: str) -> tuple[int, int, int] | None:
        """The part (dim, start, length) of expert `expert`'s `part` weight ([out, in]) this
        rank holds: SKIP for another rank's expert, None for all of it."""
        if not self.holds(expert):
            return SKIP
        if self.inter_size == self.intermediate_size:
            return None
        return (1 if part == "down_proj" else 0, self.inter_start, self.inter_size)

    def _stacked_part(self, name: str) -> tuple[int, int, int] | None:
        """The part of a stacked checkpoint tensor (transformers' in-memory layout) this
        rank reads: its experts, or every expert's down columns; None: all of it (gate_up
        under tensor parallel: two ranges of rows, narrowed once read)."""
        if self.num_local != self.num_experts:
            return (0, self.first, self.num_local)
        if self.inter_size != self.intermediate_size and name == "down_proj":
            return (2, self.inter_start, self.inter_size)
        return None

    def _load_stacked(self, param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
        """A stacked `gate_up_proj` [experts, 2 x intermediate, hidden] or `down_proj`
        [experts, hidden, intermediate], whole or as `_stacked_part` read it."""
        if tensor.dim() == 3 and tensor.shape[0] == self.num_experts:
            tensor = tensor.narrow(0, self.first, self.num_local)
        full, start, size = self.intermediate_size, self.inter_start, self.inter_size
        if tensor.dim() == 3 and size != full:
            if param is self.down_proj and tensor.shape[2] == full:
                tensor = tensor.narrow(2, start, size)
            elif param is self.gate_up_proj and tensor.shape[1] == 2 * full:
                gate, up = tensor.narrow(1, start, size), tensor.narrow(1, full + start, size)
                tensor = torch.cat([gate, up], dim=1)
        default_weight_loader(param, tensor)

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor) -> None:
        """One expert's `gate_proj`, `up_proj` or `down_proj` weight ([out, in]), whole or
        as `shard_of_expert` says."""
        target = self._expert_part(self.gate_up_proj.data, self.down_proj.data, expert, part)
        if target is None:  # another rank's
            return
        piece = self.shard_of_expert(expert, part)
        if piece is not None:
            tensor = narrowed(tensor, piece, self.intermediate_size)
        if target.shape != tensor.shape:
            raise ValueError(
                f"expert {expert} {part}: shape {tuple(tensor.shape)} != {tuple(target.shape)}"
            )
        target.copy_(tensor)

    def load_blocks(self, expert: int, part: str, rows: torch.Tensor) -> None:
        """The GGUF blocks of one expert's `part` weight: uint8 [out, blocks per row, bytes
        per block]. Used where every expert's gate, up (and down) came in one format."""
        target = self._expert_part(self.gate_up_proj, self.down_proj, expert, part)
        if target is None:
            return
        piece = self.shard_of_expert(expert, part)
        if piece is not None and piece[0] == 0:  # the rank's rows (its columns come narrowed)
            rows = narrowed(rows, piece, self.intermediate_size)
        if rows.dim() != 3 or rows.dtype != torch.uint8 or rows.shape[0] != target.shape[0]:
            raise ValueError(
                f"expert {expert} {part}: blocks of shape {tuple(rows.shape)} ({rows.dtype}) "
                f"do not fit its {target.shape[0]} rows"
            )
        self._block_parts[part, expert] = rows

    def loaded_block_bytes(self) -> int:
        """Bytes of the GGUF blocks load_blocks was given (before pack_for_cpu)."""
        return sum(rows.numel() for rows in self._block_parts.values())

    def holds(self, expert: int) -> bool:
        """Whether this rank holds expert `expert` (every rank does without EP)."""
        return self.first <= expert < self.first + self.num_local

    def _expert_part(self, gate_up, down, expert: int, part: str) -> torch.Tensor | None:
        """The rows of `part` of expert `expert` (None: another rank holds it)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range (the layer has {self.num_experts})")
        if not self.holds(expert):
            return None
        expert -= self.first
        if part == "down_proj":
            return down[expert]
        size = down.shape[2]
        start = 0 if part == "gate_proj" else size
        return gate_up[expert, start : start + size]

    def _stacked_blocks(self, name: str) -> torch.Tensor | None:
        """All experts' blocks of `name` (gate_up_proj: gate's rows, then up's), if every
        expert's came, in one format."""
        parts = ("down_proj",) if name == "down_proj" else ("gate_proj", "up_proj")
        local = range(self.first, self.first + self.num_local)
        keys = [(part, e) for e in local for part in parts]
        if any(key not in self._block_parts for key in keys):
            return None
        rows = [self._block_parts[key] for key in keys]
        if len({r.shape[1:] for r in rows}) != 1:
            return None
        return torch.cat(rows).view(self.num_local, -1, *rows[0].shape[1:])

    def grouped(self, hidden: torch.Tensor) -> bool:
        """Whether `forward` runs the experts as two grouped GEMMs (class docstring)."""
        if self.mode not in EXPERT_MODES:
            raise ValueError(f"Experts.mode must be one of {EXPERT_MODES}; got {self.mode!r}")
        if self.mode != "auto":
            return self.mode == "grouped"
        size = hidden.element_size()
        return (
            hidden.device.type == "cuda"
            and GROUPED_MM is not None
            and self.num_local == self.num_experts  # every expert is this rank's
            and self.gate_up_proj.dtype == hidden.dtype
            and all(n * size % 16 == 0 for n in (hidden.shape[1], self.inter_size))
        )

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """sum over each token's experts e of weight_e * expert_e(token)."""
        num_tokens, top_k = ids.shape
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        token_of = order // top_k
        rows = hidden.index_select(0, token_of)
        if num_tokens and self.grouped(hidden):
            ends = counts.cumsum(0).to(torch.int32)  # each expert's rows end here
            gate_up = GROUPED_MM(rows, self.gate_up_proj.transpose(1, 2), offs=ends)
            out = GROUPED_MM(silu_and_mul(gate_up), self.down_proj.transpose(1, 2), offs=ends)
        else:
            out = self._loop(rows, counts)
        out *= weights.flatten().index_select(0, order).unsqueeze(1).to(out.dtype)
        # this rank's share; over ranks SparseMoE sums the shares
        return torch.zeros_like(hidden).index_add_(0, token_of, out)

    def _loop(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each of this rank's experts' matmuls over its rows (rows sorted by expert,
        `counts` of each); another rank's experts leave zeros (expert parallel)."""
        held = self.num_local == self.num_experts
        out = torch.empty_like(rows) if held else torch.zeros_like(rows)
        start = 0
        for expert, count in enumerate(counts.tolist()):
            part = slice(start, start + count)
            start += count
            if count == 0 or not self.holds(expert):
                continue
            gate_up = self._matmul(rows[part], "gate_up_proj", expert - self.first)
            out[part] = self._matmul(silu_and_mul(gate_up), "down_proj", expert - self.first)
        return out

    def _matmul(self, x: torch.Tensor, name: str, expert: int) -> torch.Tensor:
        """x times this rank's expert `expert`'s `name` weight: decode rows from its GGUF blocks or
        through the small GEMM (W streamed once), more rows through F.linear."""
        rows = x.shape[0]
        blocks = self.blocks[name]
        if blocks is not None and rows <= BLOCK_GEMM_MAX_ROWS:
            return self.block_gemm(x.contiguous(), blocks[expert], None)
        weight = getattr(self, name)[expert]
        if self.small_gemm is not None and rows <= SMALL_GEMM_MAX_ROWS:
            return self.small_gemm(x.contiguous(), weight, None)
        return F.linear(x, weight.to(x.dtype))


class SparseMoE(nn.Module):
    """A layer's MoE MLP: the router, the routed experts, and `shared_experts` (a dense
    MLP every token goes through, or None) added to their sum.

    Over ranks each computes its share of the experts' (see Experts) and of the shared
    expert's (a tensor-parallel MLP whose down projection leaves the sum to this layer),
    summed in one all-reduce.

    Under data-parallel attention each rank comes with its own tokens (the group's
    `rank_tokens` of them; none at all is a rank's share too: it still serves the
    others' tokens) and holds the shared expert whole. The routed experts get every
    rank's tokens one of two ways (`moe_dispatch`):
    - "all-gather": every rank gathers every rank's tokens, routes them all, runs its
      share of the experts on them, and a reduce-scatter sums the shares and hands each
      rank its own tokens' rows;
    - "all-to-all" (expert parallel only): each rank routes its own tokens and sends
      each token once to every rank that holds one of its chosen experts, with its
      expert ids and weights; that rank runs those of its experts and sends back the
      token's weighted sum, which the token's rank adds up.
    """

    def __init__(self, hidden_size: int, moe: MoEConfig, shared_experts: nn.Module | None):
        super().__init__()
        self.gate = TopKRouter(hidden_size, moe)
        self.experts = Experts(hidden_size, moe)
        self.shared_experts = shared_experts
        self.group = expert_group()
        self.top_k = moe.top_k
        if shared_experts is not None:
            shared_experts.down_proj.reduce = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        group = self.group
        if group.data_parallel_attention:
            out = self._data_parallel(hidden)
        else:
            weights, ids = self.gate(hidden)
            self._count(ids)
            out = self.experts(hidden, weights, ids)
        if self.shared_experts is not None and len(hidden):
            out = out + self.shared_experts(hidden).to(out.dtype)
        if group.size > 1 and not group.data_parallel_attention:
            return group.all_reduce(out.contiguous())
        return out

    def _count(self, ids: torch.Tensor) -> None:
        """Counts tokens' experts in the statistics (over ranks of data-parallel
        attention, each rank its own tokens)."""
        counts = torch.bincount(ids.flatten(), minlength=self.experts.num_experts)
        self.experts.tokens_per_expert += counts.to(self.experts.tokens_per_expert.device)

    def _data_parallel(self, hidden: torch.Tensor) -> torch.Tensor:
        group, experts = self.group, self.experts
        if group.moe_dispatch == "all-gather":
            every = group.gather_rows(hidden)
            weights, ids = self.gate(every)
            start = sum(group.rank_tokens[: group.rank])
            self._count(ids[start : start + len(hidden)])
            return group.reduce_scatter_rows(experts(every, weights, ids))
        weights, ids = self.gate(hidden)
        self._count(ids)
        sent = send_to_experts(group, hidden, weights, ids, experts.owner)
        # another rank's experts among a token's leave zeros (Experts.forward)
        out = experts(sent.hidden, sent.weights, sent.ids)
        return sent.combine(out)


class SentTokens:
    """Tokens sent to their experts' ranks (all-to-all), as one rank received them."""

    def __init__(self, group, got, counts, token_of, max_rows, like, top_k):
        self.group, self.counts, self.token_of, self.max_rows = group, counts, token_of, max_rows
        self.like = like  # this rank's own hidden states (shape, dtype)
        width = like.shape[1]
        self.hidden = got[:, :width]
        self.ids = got[:, width : width + top_k].long()
        self.weights = got[:, width + top_k :]

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """Each received token's result back to its rank, which sums its tokens' results."""
        back, _ = self.group.all_to_all_rows(out.to(self.like.dtype), self.counts, self.max_rows)
        return torch.zeros_like(self.like).index_add_(0, self.token_of, back)


def send_to_experts(group, hidden, weights, ids, owner) -> SentTokens:
    """Sends each of this rank's tokens once to every rank that holds one of its experts
    (`owner[e]`: expert e's rank): its hidden row, then its expert ids and weights as
    columns (ids are exact in fp32)."""
    goes = torch.zeros(len(hidden), group.size, dtype=torch.bool, device=hidden.device)
    goes.scatter_(1, owner[ids], True)
    rank_of, token_of = goes.t().nonzero(as_tuple=True)  # grouped by rank
    splits = torch.bincount(rank_of, minlength=group.size).tolist()
    rows = torch.cat([hidden.float(), ids.float(), weights.float()], dim=1)
    max_rows = max(group.rank_tokens) * group.size  # a token goes to each rank once
    got, counts = group.all_to_all_rows(rows.index_select(0, token_of), splits, max_rows)
    return SentTokens(group, got, counts, token_of, max_rows, hidden, ids.shape[1])


# a per-expert checkpoint tensor: `...mlp.experts.{e}.gate_proj.weight` (Mixtral's
# w1 / w3 / w2 are gate / up / down)
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class ExpertTensors:
    """Loads per-expert checkpoint tensors into a model's stacked expert parameters and
    tells which of those every expert has filled."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = {n: m for n, m in model.named_modules() if isinstance(m, Experts)}
        self.counts: Counter[str] = Counter()

    def expert_of(self, name: str) -> tuple[Experts, int, str] | None:
        """The layer, expert index and part (gate_proj, up_proj, down_proj) of a per-expert
        tensor's name; None for others."""
        match = _EXPERT.match(name)
        layer = self.layers.get(match.group(1)) if match else None
        if layer is None:
            return None
        return layer, int(match.group(2)), _MIXTRAL_PARTS.get(match.group(3), match.group(3))

    def load(self, name: str, tensor: torch.Tensor, blocks: bool = False) -> bool:
        """False if `name` is not a per-expert tensor; `blocks`: `tensor` is its GGUF
        blocks (Experts.load_blocks)."""
        match = _EXPERT.match(name)
        if match is None:
            return False
        layer = self.layers.get(match.group(1))
        if layer is None:
            raise ValueError(f"checkpoint tensor {name!r} matches no expert layer")
        part = _MIXTRAL_PARTS.get(match.group(3), match.group(3))
        if blocks:
            layer.load_blocks(int(match.group(2)), part, tensor)
            return True
        layer.load_expert(int(match.group(2)), part, tensor)
        stacked = "down_proj" if part == "down_proj" else "gate_up_proj"
        self.counts[f"{match.group(1)}.{stacked}"] += 1
        return True

    def complete(self) -> set[str]:
        """The stacked parameters (names) whose every expert was loaded."""
        done = set()
        for name, count in self.counts.items():
            layer = self.layers[name.rsplit(".", 1)[0]]
            if count == (1 if name.endswith("down_proj") else 2) * layer.num_experts:
                done.add(name)
        return done
