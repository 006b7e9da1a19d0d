"""The tensor-parallel group a model is built for, and how its tensors split over ranks.

A model built inside `building(group)` takes its rank's share of every split tensor (see
ember.models.parallel_layers); outside it, the group is one rank and nothing is split.
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

    from ember.distributed.shm_comm import ShmCommunicator


@dataclass
class TPGroup:
    """This process's rank among `size` ranks, and what they talk through."""

    rank: int = 0
    size: int = 1
    comm: ShmCommunicator | None = None
    # mixture-of-experts layers: each rank holds a range of the experts (expert parallel),
    # the rest of the model split as above
    expert_parallel: bool = False

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


_SINGLE = TPGroup()
_current = _SINGLE


def tp_group() -> TPGroup:
    """The group the model being built is split over (one rank outside `building`)."""
    return _current


@contextlib.contextmanager
def building(group: TPGroup):
    """Models built inside take `group`'s rank's share of every split tensor."""
    global _current
    previous, _current = _current, group
    try:
        yield group
    finally:
        _current = previous


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
