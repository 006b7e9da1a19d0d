"""`ember bench startup` on a tiny checkpoint: one real cold start of `ember serve`, with
the server's start-up phases."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ember.bench.commands import add_startup_args
from ember.bench.startup import run_startup

KEYS = {
    "model",
    "weight_bytes",
    "evicted",
    "disk_read_gb_s",
    "disk_read_s",
    "runs",
    "median_ready_s",
    "median_first_chat_s",
    "median_cpu_s",
    "median_phases",
    "startup_over_disk",
}


def processes_naming(needle: str) -> list[str]:
    """Command lines of live processes, other than this one, that contain `needle`: the
    `ember.cli serve` process and its engine core (whose --config names the model)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline:
            found.append(cmdline)
    return found


def test_startup_bench(tiny_checkpoint, tmp_path, capsys):
    path = tiny_checkpoint("llama")
    out = tmp_path / "s.json"
    parser = argparse.ArgumentParser()
    add_startup_args(parser)
    args = parser.parse_args(
        [
            str(path),
            "--repeats",
            "1",
            "--out",
            str(out),
            "--serve-arg=--kv-cache-memory=16M",
            "--serve-arg=--max-model-len=512",
        ]
    )
    assert run_startup(args) == 0

    result = json.loads(out.read_text())
    assert KEYS <= result.keys()
    assert result["model"] == str(path)
    assert result["weight_bytes"] == sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert result["evicted"] is True
    assert len(result["runs"]) == 1
    run = result["runs"][0]
    assert run["first_chat_s"] >= run["ready_s"] > 0
    assert run["cpu_s"] > 0
    assert result["median_first_chat_s"] == run["first_chat_s"]
    assert result["disk_read_gb_s"] > 0
    assert result["disk_read_s"] > 0
    assert result["startup_over_disk"] > 0
    assert processes_naming(str(path)) == []

    # both processes' phases, in order, each ending before the server answered /health
    phases = {(p["process"], p["phase"]): p for p in result["median_phases"]}
    api = ["start", "args", "core configured", "server imported", "tokenizer", "core ready", "http"]
    core = ["start", "imports", "model built", "weights", "kv cache", "ready"]
    for process, names in (("api", api), ("core", core)):
        ends = [phases[process, name]["at_s"] for name in names]
        assert ends == sorted(ends)
        assert all(phases[process, name]["took_s"] >= 0 for name in names)
    # the core starts before the flags are read, and takes its config from them
    assert phases["core", "start"]["at_s"] <= phases["api", "args"]["at_s"]
    assert phases["api", "core ready"]["at_s"] >= phases["core", "ready"]["at_s"]
    assert phases["api", "http"]["at_s"] <= run["ready_s"]
    printed = capsys.readouterr().out
    assert "first chat completion" in printed
    assert "core     weights" in printed


def test_defaults():
    parser = argparse.ArgumentParser()
    add_startup_args(parser)
    args = parser.parse_args([])
    assert args.model is None
    assert (args.port, args.repeats, args.warm, args.out, args.serve_arg) == (0, 3, False, None, [])
