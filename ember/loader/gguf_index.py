"""What a start needs from a GGUF file besides its weights, kept in the cache directory.

Parsing a GGUF file's metadata with `gguf.GGUFReader` takes seconds (SmolLM2: ~6.5 s,
nearly all of it numpy views of the 49,152 vocabulary strings), and every start did it
in each process. The first open keeps, per file (keyed by path, size and mtime), an
index as JSON: the Hugging Face config derived from the metadata and each tensor's name,
GGML type, shape and byte range. Later opens read that JSON and memory-map the tensors
straight from their offsets; the tokenizer has its own cache next to it. Each index names
the file it was made from; whenever a new one is written, the entries of files since
deleted, replaced or moved (and those of an older index version) are removed, so the
cache holds about one entry per file in use rather than one per file ever opened.

    ~/.cache/ember/gguf/<key>/index.json    this index
    ~/.cache/ember/gguf/<key>/tokenizer/    the tokenizer (gguf_tokenizer)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np

from ember.loader.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("ember.loader")

INDEX_VERSION = 3  # 2: configs of MoE and MLA files; 3: the source file's path, size, mtime
# architectures whose config transformers' GGUF support cannot read (their tokenizer is
# built without it)
TOKENIZER_ONLY_ARCHITECTURES = frozenset({"deepseek2"})
_PLAIN_DTYPES = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    tensor_type: int  # gguf.GGMLQuantizationType value
    shape: list[int]  # GGUF order: innermost dimension first
    data_offset: int  # absolute byte offset in the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFIndex:
    architecture: str  # general.architecture
    hf_config: dict
    tensors: list[TensorEntry]


class IndexedTensor:
    """A tensor of an indexed file, shaped like gguf's ReaderTensor (`data` as gguf gives
    it: plain types as their dtype, quantized ones as rows of raw bytes)."""

    def __init__(self, entry: TensorEntry, file_bytes: np.ndarray) -> None:
        self.name = entry.name
        self.tensor_type = gguf.GGMLQuantizationType(entry.tensor_type)
        self.shape = np.array(entry.shape)
        raw = file_bytes[entry.data_offset : entry.data_offset + entry.n_bytes]
        dims = list(reversed(entry.shape))
        dtype = _PLAIN_DTYPES.get(self.tensor_type)
        if dtype is not None:
            self.data = raw.view(dtype).reshape(dims)
        else:
            block_size, type_size = gguf.GGML_QUANT_SIZES[self.tensor_type]
            dims[-1] = dims[-1] // block_size * type_size
            self.data = raw.reshape(dims)


def _cache_root() -> Path:
    from ember import envs

    return envs.cache_dir() / "gguf"


def _source(path: Path) -> dict:
    """What keys a file's entry: its resolved path, size and modification time."""
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _key(source: dict) -> str:
    key = f"{source['path']}:{source['size']}:{source['mtime_ns']}"
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def cache_dir(path: Path) -> Path:
    """Where this file's index and tokenizer are kept."""
    return _cache_root() / _key(_source(path))


def load_index(path: Path) -> GGUFIndex:
    """The file's index, from the cache or built (and kept) from a full parse."""
    source = _source(path)
    target = _cache_root() / _key(source) / "index.json"
    try:
        data = json.loads(target.read_text())
        if data.get("version") == INDEX_VERSION:
            tensors = [TensorEntry(**t) for t in data["tensors"]]
            return GGUFIndex(data["architecture"], data["hf_config"], tensors)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not there yet, or unreadable: parse the file
    from ember.loader.gguf_loader import gguf_to_hf_config, read_gguf

    reader = read_gguf(path)
    hf_config = gguf_to_hf_config(reader)  # checks the architecture
    index = GGUFIndex(
        str(reader.get_field("general.architecture").contents()),
        hf_config,
        [
            TensorEntry(t.name, int(t.tensor_type), [int(d) for d in t.shape],
                        int(t.data_offset), int(t.n_bytes))
            for t in reader.tensors
        ],
    )  # fmt: skip
    _save(index, source, target)
    prune_stale_entries(keep=target.parent)
    return index


def tensors(path: Path, index: GGUFIndex) -> list[IndexedTensor]:
    file_bytes = np.memmap(path, dtype=np.uint8, mode="r")
    return [IndexedTensor(entry, file_bytes) for entry in index.tensors]


def prune_stale_entries(keep: Path | None = None) -> int:
    """Removes the cache's entries (index and tokenizer) whose file is gone or changed, or
    whose index is of another version or unreadable; `keep`: an entry left whatever it
    holds (the one being written). Entries without an index yet (a tokenizer cached
    alone) are left. Returns how many were removed; errors only leave entries behind."""
    removed = 0
    try:
        entries = [e for e in _cache_root().iterdir() if e.is_dir() and not e.is_symlink()]
    except OSError:
        return 0
    for entry in entries:
        if entry == keep or not _stale(entry):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed += 1
    if removed:
        logger.debug("GGUF cache: removed %d entries of files gone or changed", removed)
    return removed


def _stale(entry: Path) -> bool:
    index = entry / "index.json"
    if not index.is_file():
        return False  # another process's entry in the making, or a tokenizer alone
    try:
        data = json.loads(index.read_text())
        if data.get("version") != INDEX_VERSION:
            return True
        return _key(_source(Path(data["source"]["path"]))) != entry.name
    except (OSError, ValueError, KeyError, TypeError):  # the file gone (OSError) included
        return True


def _save(index: GGUFIndex, source: dict, target: Path) -> None:
    """Writes atomically; an index that cannot be written only costs the next start."""
    data = {"version": INDEX_VERSION, "source": source, **asdict(index)}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=target.parent, delete=False) as f:
            json.dump(data, f)
        os.replace(f.name, target)
    except OSError as exc:
        logger.debug("GGUF index not written to %s: %s", target, exc)


def gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer stored in a GGUF file, with its chat template (via transformers' GGUF
    support). Building it parses the whole file's metadata (~10 s for SmolLM2), so the
    result is kept in the cache directory, keyed by the file's path, size and mtime."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    cached = _tokenizer_cache_dir(path)
    if (cached / "tokenizer_config.json").is_file():
        tokenizer = load_tokenizer(cached)
    else:
        # here: the engine process never needs them
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        # AutoTokenizer reads the model's config through transformers' GGUF support, which
        # lacks some architectures ember reads (deepseek2); the fast tokenizer built from
        # the file's vocabulary is what it would build there too
        builder = (
            PreTrainedTokenizerFast
            if load_index(path).architecture in TOKENIZER_ONLY_ARCHITECTURES
            else AutoTokenizer
        )
        tokenizer = builder.from_pretrained(str(path.parent), gguf_file=path.name)
        _save_tokenizer(tokenizer, cached)
    if tokenizer.eos_token is None:
        raise ValueError(f"GGUF tokenizer in {path} has no eos token")
    if tokenizer.chat_template is None:
        logger.warning("GGUF file %s has no tokenizer.chat_template; chat requests will fail", path)
    return tokenizer


def _tokenizer_cache_dir(path: Path) -> Path:
    return cache_dir(path) / "tokenizer"


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Saves atomically (another process may be building the same one); a cache that
    cannot be written only costs the next start its time."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            tokenizer.save_pretrained(tmp)
            os.rename(tmp, target)
            os.mkdir(tmp)  # for TemporaryDirectory's own cleanup
    except OSError as exc:
        logger.debug("tokenizer cache not written to %s: %s", target, exc)
