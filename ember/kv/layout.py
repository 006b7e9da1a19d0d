"""Which part of a model's KV each of a worker's cache tensors holds, and how blocks move
between workers whose ranks split that KV differently.

A worker keeps one tensor per layer, `[parts, num_blocks, block_size, heads, head_dim]`
(ember.engine.kv_spec). One process holds every layer and every KV head; a model over
ranks splits them: a pipeline stage holds a range of the layers, a tensor-parallel rank
a range of the KV heads (the same head on several ranks where they share one; MLA's
latent is whole on every rank). A `Piece` names what one tensor holds: a layer and the
model's KV heads [head_start, head_stop) of it.

A worker whose model spans ranks and that runs KV connectors (disaggregation, the KV
tiers) keeps every rank's tensors in one shared-memory file, rank by rank
(`ModelRunner.allocate_kv_cache`), so that rank 0, which runs the connectors, reads and
writes every rank's KV. `WorkerKV` is what the connectors see: one tensor per distinct
piece (the ones that move, in file order) and the copies on other ranks that a load
fills too.

Between workers with the same pieces blocks move tensor to tensor, as bytes. Between
workers whose pieces differ (a one-process prefill worker and a two-rank decode worker,
or two ranks and four), the receiver takes the sender's tensors into a staging buffer
and copies each of its own pieces' heads out of them (`reshard_plan`, `reshard`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # torch-free at import: the API process checks handed-over params
    import torch

MAX_PIECES = 1 << 16  # what a handed-over prefill may describe (a layer per rank: plenty)


class Piece(NamedTuple):
    layer: int  # the model's layer index
    head_start: int  # the model's KV heads [head_start, head_stop) in this tensor
    head_stop: int


@dataclass
class WorkerKV:
    """A worker's KV as its connectors see it (module docstring)."""

    tensors: list[torch.Tensor]  # one per distinct piece, in file order
    pieces: list[Piece]
    replicas: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (of, copy)
    shm_path: str | None = None  # the file every tensor is a view of, if any
    shm_offsets: list[int] | None = None  # where each of `tensors` starts in it (bytes)

    @classmethod
    def of(
        cls,
        tensors: Sequence[torch.Tensor],
        pieces: Sequence[Piece],
        shm_path: str | None = None,
        shm_offsets: Sequence[int] | None = None,
    ) -> WorkerKV:
        """Every tensor of a worker with its piece: a piece seen again is a replica."""
        index: dict[Piece, int] = {}
        kept, kept_pieces, offsets, replicas = [], [], [], []
        for i, (tensor, piece) in enumerate(zip(tensors, pieces, strict=True)):
            if piece in index:
                replicas.append((index[piece], tensor))
                continue
            index[piece] = len(kept)
            kept.append(tensor)
            kept_pieces.append(piece)
            if shm_offsets is not None:
                offsets.append(shm_offsets[i])
        return cls(kept, kept_pieces, replicas, shm_path, offsets if shm_offsets else None)

    def every_tensor(self) -> list[torch.Tensor]:
        """The tensors and their replicas: every rank's KV."""
        return self.tensors + [replica for _, replica in self.replicas]

    @property
    def head_block_bytes(self) -> int:
        """Bytes of one KV head in one block of one layer (every piece has the same)."""
        if not self.tensors:
            return 0
        t = self.tensors[0]
        return t.shape[0] * t.shape[2] * t.shape[4] * t.element_size()

    def fill_replicas(self, block_ids: Sequence[int]) -> None:
        """Copies blocks just loaded into the tensors to their replicas on other ranks."""
        if not self.replicas or not block_ids:
            return
        import torch

        index = torch.tensor(list(block_ids), dtype=torch.long)
        for source, replica in self.replicas:
            replica.index_copy_(1, index, self.tensors[source].index_select(1, index))

    def check_sender(self, pieces: Sequence[Piece], block_bytes: int) -> list | None:
        """How blocks of a sender with these pieces land here: None when the pieces are
        ours (byte for byte), else the reshard plan. ValueError when the sender's KV is
        not this model's (its bytes per head differ, or it lacks a head we hold)."""
        heads = sum(p.head_stop - p.head_start for p in pieces)
        if not heads or block_bytes != heads * self.head_block_bytes:
            raise ValueError("the prefill worker's KV layout differs")
        if list(pieces) == self.pieces:
            return None
        return reshard_plan(pieces, self.pieces)


def reshard_plan(src: Sequence[Piece], dst: Sequence[Piece]) -> list[list[tuple[int, ...]]]:
    """For each piece of `dst`, the runs that fill it from `src`: (src index, first head
    in it, first head in the dst piece, heads). ValueError if `src` lacks a head."""
    by_layer: dict[int, list[tuple[int, Piece]]] = {}
    for i, piece in enumerate(src):
        by_layer.setdefault(piece.layer, []).append((i, piece))
    plan = []
    for piece in dst:
        runs, head = [], piece.head_start
        while head < piece.head_stop:
            candidates = by_layer.get(piece.layer, [])
            found = next(((i, p) for i, p in candidates if p.head_start <= head < p.head_stop),
                         None)  # fmt: skip
            if found is None:
                raise ValueError(
                    f"the prefill worker's KV has no head {head} of layer {piece.layer}"
                )
            i, source = found
            count = min(source.head_stop, piece.head_stop) - head
            runs.append((i, head - source.head_start, head - piece.head_start, count))
            head += count
        plan.append(runs)
    return plan


def staging(pieces: Sequence[Piece], like: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """Tensors for `num_blocks` blocks of a sender's pieces (shaped as `like`'s layer)."""
    import torch

    parts, _, block_size, _, head_dim = like.shape
    return [
        torch.empty((parts, num_blocks, block_size, p.head_stop - p.head_start, head_dim),
                    dtype=like.dtype)
        for p in pieces
    ]  # fmt: skip


def reshard(
    src: Sequence[torch.Tensor], plan: list, dst: Sequence[torch.Tensor], dst_ids: Sequence[int]
) -> None:
    """Copies staged blocks 0..n-1 of the sender's tensors into blocks `dst_ids` of ours."""
    import torch

    index = torch.tensor(list(dst_ids), dtype=torch.long)
    for tensor, runs in zip(dst, plan, strict=True):
        for i, src_head, dst_head, count in runs:
            heads = src[i][:, :, :, src_head : src_head + count]
            tensor[:, :, :, dst_head : dst_head + count].index_copy_(1, index, heads)
