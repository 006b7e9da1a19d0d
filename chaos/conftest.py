"""`make chaos`: the fuzz and chaos families against real ember processes on loopback
(a tiny random checkpoint), each bounded in cases and time; each prints its figures and
adds them to chaos-figures.json (docs/reliability.md reports them)."""

from __future__ import annotations

import json
import runpy
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
FIGURES = ROOT / "chaos-figures.json"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    build = runpy.run_path(str(ROOT / "tests" / "conftest.py"))["build_checkpoint"]
    return str(build(tmp_path_factory.mktemp("llama"), "llama"))


@pytest.fixture(scope="session", autouse=True)
def exact_matmuls():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EMBER_MATMUL_PRECISION", "ieee")
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


def report(family: str, figures: dict) -> None:
    """Prints a family's figures and keeps them in chaos-figures.json."""
    print(f"\n[chaos] {family}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    known = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    known[family] = figures
    FIGURES.write_text(json.dumps(known, indent=2) + "\n")


def run_for(seconds: float, stop: threading.Event, *targets: Callable[[], None]) -> None:
    """Runs each target on a thread of its own for `seconds`, then sets `stop` (which the
    targets watch) and waits for them."""
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(timeout=180)
