"""The tensor-parallel group and pipeline stage a model is built for, and how its tensors
split over ranks.

A model built inside `building(group, stage)` takes its rank's share of every split tensor
(see ember.models.parallel_layers) and only its stage's layers; outside it, the group is
one rank, the stage holds every layer, and nothing is split.
Splits are contiguous ranges, as even as they go (the first ranks take one more where
the count does not divide): vocabularies and MLP widths of any size split over any
number of ranks. Attention splits by KV head, each rank with the query heads that read
its KV heads, so that every rank keeps the model's grouping of query heads per KV head:
with fewer KV heads than ranks, each KV head is replicated on the ranks that share its
query heads.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: the API process reads `split` (metrics)
    import torch

    from ember.config import EngineConfig
    from ember.distributed.shm_comm import ShmCommunicator


# what a rank's `narrow` says of a checkpoint tensor it does not load at all (another
# rank's expert, another pipeline stage's layer); see Checkpoint.weights
SKIP = (0, 0, 0)


@dataclass
class TPGroup:
    """This process's rank among `size` ranks, and what they talk through."""

    rank: int = 0
    size: int = 1
    comm: ShmCommunicator | None = None
    # mixture-of-experts layers: each rank holds a range of the experts (expert parallel),
    # the rest of the model split as above
    expert_parallel: bool = False
    # attention data-parallel: every rank holds the whole model but the experts (which
    # split as above) and runs its own sequences; a MoE layer brings every rank's tokens
    # to the experts (`moe_dispatch`: "all-gather" or "all-to-all") and back
    data_parallel_attention: bool = False
    moe_dispatch: str = "all-gather"
    # under data_parallel_attention, each rank's tokens in the step being run (set before
    # each forward; every rank knows every rank's)
    rank_tokens: list[int] | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (in place; every rank gets the same bits)."""
        if self.size == 1:
            return tensor
        return self.comm.all_reduce(tensor)

    def all_gather_columns(self, tensor: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Each rank's [rows, widths[rank]] side by side, in rank order: [rows, sum(widths)]."""
        if self.size == 1:
            return tensor
        import torch

        width = max(widths)
        if tensor.shape[1] < width:  # every rank sends the same shape
            tensor = torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))
        parts = self.comm.all_gather(tensor.contiguous()).view(self.size, -1, width)
        return torch.cat([parts[r, :, : widths[r]] for r in range(self.size)], dim=1)

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of this step (`rank_tokens`), in rank order."""
        if self.size == 1:
            return tensor
        return self.comm.all_gather_rows(tensor.contiguous(), self.rank_tokens)

    def reduce_scatter_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `tensor` (every rank's rows of this step), this rank's rows."""
        if self.size == 1:
            return tensor
        return self.comm.reduce_scatter_rows(tensor.contiguous(), self.rank_tokens)

    def all_to_all_rows(
        self, tensor: torch.Tensor, splits: list[int], max_rows: int
    ) -> tuple[torch.Tensor, list[int]]:
        """Rows of `tensor` to each rank (`splits[d]` to rank d, in order); the rows every
        rank sent here and how many each (see ShmCommunicator.all_to_all_rows)."""
        return self.comm.all_to_all_rows(tensor.contiguous(), splits, max_rows)


@dataclass
class PipelineStage:
    """This process's pipeline stage among `size`, and its place in that stage's
    tensor-parallel group. Global ranks go stage by stage: stage s, tensor-parallel rank t
    is rank s * tp_size + t. The first stage embeds the tokens and holds the final norm
    and LM head too (so that rank 0, which samples, has them), and fewer layers for it;
    each stage sends its residual stream to the next stage's rank of the same t, and the
    last stage's rank 0 sends the final one back to rank 0."""

    stage: int = 0
    size: int = 1
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.size - 1

    def layers(self, num_layers: int, head_layers: float = 0.0) -> range:
        """The layers this stage holds: contiguous ranges, as even as they go once the
        first stage's head counts as `head_layers` layers (its matmul, in layers' worth
        of weights); later stages take one more where the count does not divide."""
        if self.size == 1:
            return range(num_layers)
        even = (num_layers + head_layers) / self.size
        first = min(max(1, round(even - head_layers)), num_layers - (self.size - 1))
        if self.stage == 0:
            return range(first)
        rest, others = num_layers - first, self.size - 1
        lengths = [split(rest, others, others - 1 - s)[1] for s in range(others)]
        start = first + sum(lengths[: self.stage - 1])
        return range(start, start + lengths[self.stage - 1])

    def rank_of(self, stage: int) -> int:
        """The global rank of `stage`'s tensor-parallel rank alike to this one."""
        return stage * self.tp_size + self.tp_rank

    def send(self, tensor: torch.Tensor, stage: int):
        """Starts sending `tensor` to `stage` (its rank alike to this one); the Work."""
        import torch.distributed as dist

        return dist.isend(tensor.contiguous(), self.rank_of(stage))

    def recv(self, out: torch.Tensor, stage: int) -> torch.Tensor:
        """Receives into `out` from `stage`."""
        wait(self.irecv(out, stage))
        return out

    def irecv(self, out: torch.Tensor, stage: int):
        import torch.distributed as dist

        return dist.irecv(out, self.rank_of(stage))


def wait(work, check=None) -> None:
    """Waits for a point-to-point Work (Gloo's report completion only once waited on;
    a peer that exits closes its sockets, and the wait raises), then `check`s the peers."""
    try:
        work.wait()
    finally:
        if check is not None:
            check()


_SINGLE = TPGroup()
_ONE_STAGE = PipelineStage()
_current = _SINGLE
_stage = _ONE_STAGE


def tp_group() -> TPGroup:
    """The group the model being built is split over (one rank outside `building`, and
    under data-parallel attention, where only the experts split)."""
    return _SINGLE if _current.data_parallel_attention else _current


def expert_group() -> TPGroup:
    """The group the model's experts split over."""
    return _current


def pp_stage() -> PipelineStage:
    """The pipeline stage the model being built is (the only one outside `building`)."""
    return _stage


@contextlib.contextmanager
def building(group: TPGroup, stage: PipelineStage | None = None):
    """Models built inside take `group`'s rank's share of every split tensor, and only
    `stage`'s layers."""
    global _current, _stage
    previous = _current, _stage
    _current, _stage = group, stage or _ONE_STAGE
    try:
        yield group
    finally:
        _current, _stage = previous


def split(total: int, size: int, rank: int) -> tuple[int, int]:
    """(start, length) of rank `rank`'s contiguous share of `total` over `size` ranks."""
    base, extra = divmod(total, size)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(frozen=True)
class HeadSplit:
    """A rank's attention heads: query heads [q_start, q_start + num_q) and KV heads
    [kv_start, kv_start + num_kv) of the model's."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def head_split(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadSplit:
    """Rank `rank`'s heads (see the module docstring). ValueError when the heads cannot
    be split so (fewer KV heads than ranks, and the ranks do not share them evenly)."""
    group = num_heads // num_kv_heads
    if size <= num_kv_heads:
        kv_start, num_kv = split(num_kv_heads, size, rank)
        return HeadSplit(kv_start * group, num_kv * group, kv_start, num_kv)
    ranks_per_kv = size // num_kv_heads
    if size % num_kv_heads or group % ranks_per_kv:
        raise ValueError(
            f"tensor_parallel_size={size}: the model's {num_kv_heads} KV heads (each read by "
            f"{group} query heads) cannot be shared evenly by {size} ranks; use a size that "
            f"divides {num_kv_heads}, or a multiple of it that divides {num_heads}"
        )
    kv = rank // ranks_per_kv
    num_q = group // ranks_per_kv
    return HeadSplit(kv * group + (rank % ranks_per_kv) * num_q, num_q, kv, 1)


def check_data_parallel_attention(config: EngineConfig) -> None:
    """What data-parallel attention needs and does not do yet (its KV lives on the rank
    that runs each sequence: the KV connectors, which reach every rank's tensors for
    the same blocks, do not apply; a pipeline or drafts over it are not built)."""
    name = "data_parallel_attention"
    if config.tensor_parallel_size < 2:
        raise ValueError(f"{name} needs tensor_parallel_size >= 2 (the ranks it runs over)")
    if config.moe_dispatch == "all-to-all" and not config.expert_parallel:
        raise ValueError(
            "moe_dispatch 'all-to-all' sends each token to its experts' ranks: it needs "
            "expert_parallel (within-expert splits need every token on every rank)"
        )
    refused = []
    if config.pipeline_parallel_size > 1:
        refused.append(f"pipeline_parallel_size={config.pipeline_parallel_size}")
    if config.moves_kv:
        refused.append("KV connectors (kv_role prefill / decode, KV tiers)")
    if config.speculative_method is not None:
        refused.append(f"speculative_method {config.speculative_method!r}")
    if refused:
        raise ValueError(f"{name} does not work with {', '.join(refused)} yet")


MOE_DISPATCHES = ("auto", "all-gather", "all-to-all")


def check_parallel_config(config: EngineConfig) -> None:
    """The config's parallel options, checked (ValueError naming the parameter)."""
    from ember.distributed.nodes import check_nodes

    if config.moe_dispatch not in MOE_DISPATCHES:
        raise ValueError(
            f"moe_dispatch must be one of {', '.join(MOE_DISPATCHES)}; got {config.moe_dispatch!r}"
        )
    if config.data_parallel_attention:
        check_data_parallel_attention(config)
    elif config.moe_dispatch != "auto":
        raise ValueError("moe_dispatch applies to data_parallel_attention only")
    check_nodes(config.world_size, config.nnodes, config.dist_init_addr, config.moves_kv)
    # hidden-state drafters read rank 0's hidden states alone; a pipeline's steps overlap,
    # and drafts need each step's tokens before the next
    method = config.speculative_method
    if method in ("eagle3", "mtp") or (method is not None and config.pipeline_parallel_size > 1):
        name = (
            f"tensor_parallel_size={config.tensor_parallel_size}"
            if config.pipeline_parallel_size == 1
            else f"pipeline_parallel_size={config.pipeline_parallel_size}"
        )
        raise ValueError(f"{name} does not work with speculative_method {method!r} yet")
