"""The layers a tensor-parallel model splits over its ranks (ember.distributed.parallel).

- `MergedLinear` with `slices` (layers.py): column-parallel; each part of a fused
  projection (QKV, gate/up) keeps its rank's rows, no communication;
  `ColumnParallelLinear` the same for a single projection (MLA's per-head ones);
- `RowParallelLinear`: the input features split; each rank's partial product is summed
  over the ranks (one all-reduce after o_proj and after down_proj per layer; a MoE
  layer's shared expert leaves it to the layer, which sums it with the experts');
- `VocabParallelEmbedding`: each rank holds a range of the vocabulary's rows, looks up
  the ids in it (zeros elsewhere), and the ranks' lookups are summed;
- `ParallelLMHead`: each rank's logits over its vocabulary range, gathered side by side.

Every split parameter says which part of the checkpoint tensor it holds
(`param.shard_of(shard_id) -> (dim, start, length)`), so that the loader reads only that
part; `narrowed` takes a rank's part of a tensor read whole.
With one rank these are the plain layers: nothing is split and nothing communicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed.parallel import TPGroup, split
from ember.models.layers import Linear, default_weight_loader, meta_param, new_param

Slice = tuple[int, int, int]  # (dim, start, length) of a checkpoint tensor


def narrowed(tensor: torch.Tensor, part: Slice, full: int) -> torch.Tensor:
    """`tensor`'s part `part` when it is the whole checkpoint tensor (`full` long in that
    dim); as is when the loader has already read only that part."""
    dim, start, length = part
    if tensor.dim() > dim and tensor.shape[dim] == full:
        return tensor.narrow(dim, start, length)
    return tensor


def _shard_param(param: nn.Parameter, part: Slice, full: int) -> nn.Parameter:
    """Makes `param` hold part `part` of its checkpoint tensor (`full` long in that dim)."""

    def load(param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, narrowed(tensor, part, full))

    param.weight_loader = load
    param.shard_of = lambda shard_id=None: part
    return param


class ColumnParallelLinear(Linear):
    """y = x W_r^T, W_r this rank's rows [start, start + length) of the `out_features`
    outputs (one projection; fused ones are MergedLinear with slices): no communication."""

    def __init__(
        self, in_features: int, out_features: int, group: TPGroup, part: tuple[int, int],
        bias: bool = False,
    ) -> None:  # fmt: skip
        start, length = part
        super().__init__(in_features, length, bias)
        if group.size > 1:
            for param in (self.weight, self.bias):
                if param is not None:
                    _shard_param(param, (0, start, length), out_features)


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T, where x_r and W_r are the rank's input features
    [start, start + length) of `in_features` (no bias: the Llama family has none here)."""

    def __init__(self, in_features: int, out_features: int, group: TPGroup, part: tuple[int, int]):
        start, length = part
        super().__init__(length, out_features)
        self.group = group
        # False: the caller sums the ranks' partial products (with others of its own)
        self.reduce = True
        if group.size > 1:
            _shard_param(self.weight, (1, start, length), in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.group.size == 1 or not self.reduce:
            return y
        y = y.contiguous() if y.dtype == torch.float32 else y.float()
        return self.group.all_reduce(y)


class VocabParallelEmbedding(nn.Module):
    """The embedding table's rows of this rank's vocabulary range.

    With one rank and a GGUF file's blocks of the table (`load_blocks`), the lookup can
    decode just the rows it gives from them (`read_blocks`; the CPU kernels' decoders,
    the values the table read as floats holds): the fp32 table (4 bytes a weight, 113 MB
    for SmolLM2's 49k x 576, against its 30 MB of Q8_0 blocks) is then neither read
    from the file nor kept."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.start, length = split(vocab_size, group.size, group.rank)
        self.weight = new_param(length, hidden_size)
        if group.size > 1:
            _shard_param(self.weight, (0, self.start, length), vocab_size)
        self.blocks: torch.Tensor | None = None  # uint8 [vocab, blocks per row, bytes]
        self.from_blocks = False  # rows decoded from the blocks; W never read
        self._decode = None  # the kernels' dequantize_blocks, once from_blocks

    def load_blocks(self, rows: torch.Tensor) -> None:
        """The checkpoint's raw blocks of the table, a row per token (kept with one rank
        only: a rank's range of them is not made here)."""
        if self.group.size == 1 and rows.shape[0] == self.weight.shape[0]:
            self.blocks = rows

    def read_blocks(self, kernels) -> bool:
        """From now on looks rows up in the blocks (given load_blocks and the CPU kernels);
        W's shape stays, on the meta device, so that a read of it fails loudly. Whether
        it does."""
        if self.blocks is None or kernels is None:
            return False
        self.from_blocks, self._decode = True, kernels.dequantize_blocks
        self.weight = meta_param(self.weight)
        return True

    def loaded_block_bytes(self) -> int:
        """What its blocks hold where the lookup reads them (planned_weight_bytes)."""
        return self.blocks.numel() if self.from_blocks else 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.from_blocks:
            rows = self.blocks.index_select(0, input_ids.reshape(-1))
            return self._decode(rows, False).view(*input_ids.shape, -1)
        if self.group.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        rows = rows.float() * inside.unsqueeze(1)  # one rank adds each row, the rest zeros
        return self.group.all_reduce(rows.contiguous())


class ParallelLMHead(Linear):
    """Logits over the whole vocabulary from each rank's vocabulary range (a tied head
    multiplies by the same range of the embedding table)."""

    def __init__(self, hidden_size: int, vocab_size: int, group: TPGroup) -> None:
        start, length = split(vocab_size, group.size, group.rank)
        super().__init__(hidden_size, length)
        self.group = group
        self.widths = [split(vocab_size, group.size, r)[1] for r in range(group.size)]
        if group.size > 1:
            _shard_param(self.weight, (0, start, length), vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_columns(super().forward(x), self.widths)


def column_slices(sizes: list[int], group: TPGroup) -> list[tuple[int, int]]:
    """Each part's (start, length) of its rows on this rank, the parts split evenly."""
    return [split(size, group.size, group.rank) for size in sizes]


def shard_of(params: dict[str, nn.Parameter], name: str, shard: int | None) -> Slice | None:
    """The part of checkpoint tensor `name` (parameter `name`, part `shard` of a fused one)
    this rank holds; None: the whole tensor."""
    param = params.get(name)
    part = getattr(param, "shard_of", None)
    return None if part is None else part(shard)
