"""Opening a checkpoint: a Hugging Face directory (safetensors) or a GGUF file.

Weights are read memory-mapped, one tensor at a time, behind a progress bar; opening a
checkpoint reads only its config (the API process opens one for its tokenizer, without
torch). Pickle checkpoints (`*.bin`, `*.pt`) are refused: loading them can run arbitrary
code.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("ember.loader")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# the part (dim, start, length) of a tensor (by name) that is wanted; None: all of it
Narrow = Callable[[str], "tuple[int, int, int] | None"]


@dataclass
class Checkpoint:
    """A checkpoint on disk: its config.json-style dict, weights and tokenizer."""

    path: Path
    hf_config: dict
    is_gguf: bool
    files: list[Path] = field(default_factory=list)
    gguf_index: Any = None  # a .gguf checkpoint's GGUFIndex (config and tensor offsets)

    @property
    def num_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def identity(self) -> str:
        """This checkpoint's files as they are on disk (path, size, modification time):
        what KV computed from it is stored under (ember.kv.tiers)."""
        parts = [str(self.path.resolve())]
        for file in self.files:
            stat = file.stat()
            parts.append(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}")
        return "|".join(parts)

    def tiled_share(self) -> float:
        """The share of this checkpoint's matrix weights (2-D and stacked tensors) held in
        GGUF blocks that the int8 tiles take (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), from the
        file's index: nothing read. 0 for other checkpoints."""
        if not self.is_gguf:
            return 0.0
        from ember.loader.dequant import TILED_FORMATS

        tiled = total = 0
        for entry in self.gguf_index.tensors:
            if len(entry.shape) >= 2:
                count = math.prod(entry.shape)
                total += count
                tiled += count if entry.tensor_type in TILED_FORMATS else 0
        return tiled / total if total else 0.0

    def weights(self, narrow: Narrow | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) pairs, with a progress bar and a timing log line.
        `narrow(name)`: the part (dim, start, length) of that tensor wanted (a tensor-
        parallel rank's share), read alone from the mapped file; None: all of it."""
        start = time.perf_counter()
        if self.is_gguf:
            source = self._gguf_weights(narrow)
        else:
            source = self._safetensors_weights(narrow)
        yield from tqdm(source, desc="Loading weights", unit=" tensors", leave=False)
        seconds = time.perf_counter() - start
        logger.info(
            "loaded weights from %s: %.2f GB read in %.2f s (%.2f GB/s)",
            self.path,
            self.num_bytes / 1e9,
            seconds,
            self.num_bytes / 1e9 / max(seconds, 1e-9),
        )

    def gguf_blocks(
        self, narrow: Narrow | None = None, shapes_only: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A GGUF file's matrices in gguf_loader.BLOCK_FORMATS as raw blocks (nothing for
        other checkpoints): decode steps read these instead of the fp32 weights.
        `shapes_only`: meta tensors of their shapes, nothing read."""
        if not self.is_gguf:
            return
        from ember.loader.gguf_loader import iter_indexed_blocks

        yield from iter_indexed_blocks(
            self.path, self.gguf_index, self.hf_config, narrow, shapes_only
        )

    def tokenizer(self):
        """The checkpoint's tokenizer, or None (with a warning) when it has none."""
        try:
            if self.is_gguf:
                from ember.loader.gguf_index import gguf_tokenizer

                return gguf_tokenizer(self.path)
            from ember.loader.tokenizer import load_tokenizer

            return load_tokenizer(self.path)
        # transformers' GGUF tokenizer reader raises KeyError for absent vocabulary fields
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("no tokenizer in %s (%s); only token-id prompts work", self.path, exc)
            return None

    def _safetensors_weights(self, narrow: Narrow | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of every file. A file's mapping is dropped and made again every
        MAPPED_BYTES read: the pages a mapping has touched count in the process's resident
        memory while it lasts, and a shard is several GB (resident memory at load would
        be the weights twice over)."""
        from safetensors import SafetensorError

        for file in self.files:
            try:
                start: int | None = 0
                while start is not None:
                    start = yield from _some_tensors(file, start, narrow)
            except SafetensorError as exc:
                raise ValueError(f"corrupt or truncated safetensors file {file}: {exc}") from exc

    def _gguf_weights(self, narrow: Narrow | None) -> Iterator[tuple[str, torch.Tensor]]:
        from ember.loader.gguf_loader import iter_indexed_weights

        yield from iter_indexed_weights(self.path, self.gguf_index, self.hf_config, narrow)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Finds the config and weight files of a checkpoint; reads no weights yet."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from ember.loader.gguf_index import load_index

        index = load_index(path)
        return Checkpoint(path, index.hf_config, True, [path], index)
    if not path.is_dir():
        raise ValueError(f"model {str(path)!r} is neither a directory nor a .gguf file")
    config_file = path / "config.json"
    if not config_file.exists():
        raise ValueError(f"{path} has no config.json")
    try:
        hf_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file} is not valid JSON: {exc}") from exc
    return Checkpoint(path, hf_config, False, _safetensors_files(path))


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ValueError(f"shards named in {index} are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickled = [p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickled:
        raise ValueError(
            f"{path} holds only pickle checkpoints ({', '.join(pickled)}); ember refuses "
            "to load pickle. Convert them to safetensors first."
        )
    raise ValueError(f"{path} holds no *.safetensors weights")


MAPPED_BYTES = 256 << 20


def _some_tensors(file: Path, start: int, narrow: Narrow | None = None):
    """Tensors `start`, `start + 1`, ... of `file` under one mapping, until MAPPED_BYTES
    are read; returns where the next mapping starts (None at the end)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        names, mapped = list(f.keys()), 0
        for i in range(start, len(names)):
            part = narrow(names[i]) if narrow is not None else None
            if part is None:
                tensor = f.get_tensor(names[i])
            else:  # only the part's bytes are read from the mapping
                dim, first, length = part
                index = (slice(None),) * dim + (slice(first, first + length),)
                tensor = f.get_slice(names[i])[index]
            yield names[i], tensor
            mapped += tensor.nbytes
            if mapped >= MAPPED_BYTES and i + 1 < len(names):
                return i + 1
    return None
