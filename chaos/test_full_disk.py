"""A full disk under the disk tier: a worker whose --kv-disk-dir is a 1 MiB tmpfs (room
for ~128 of the tiny model's block files, though --kv-disk-size says 1G) and whose pool
holds two prompts, under six clients each asking for one of 4 hot prompts every other
turn and one of 8 cold ones between (240 blocks in all): the tier fills the disk itself.
A third of the way in, another file starts taking every page that comes free on that
disk (the tier shrinks to nothing, its writes fail) and is deleted a third later (the
tier grows back). Every answer must be the one a worker without tiers gives, no request
may fail, the tier must serve hits before, and after the filler is gone, and no block
may stay used."""

from __future__ import annotations

import functools
import subprocess
import threading
import time

import httpx
import pytest

from conftest import report, run_for
from server_utils import EmberServer

SECONDS = 24
CLIENTS = 6
PROMPTS = [[(7 * i + 13 * p) % 500 + 3 for i in range(160)] for p in range(12)]
BODY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
ARGS = ["--max-model-len", "256", "--block-size", "8"]


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs the right to mount: root, or CAP_SYS_ADMIN)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"a small file system cannot be mounted here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(mount, seconds: float) -> int:
    """For `seconds`, takes every page of `mount` that comes free (the tier deletes its
    older blocks to make room for new ones: this file takes that room first); its size."""
    written, deadline = 0, time.monotonic() + seconds
    with open(mount / "filler", "wb", buffering=0) as f:
        while time.monotonic() < deadline:
            try:
                written += f.write(b"\0" * 4096)
            except OSError:
                time.sleep(0.005)
    return written


def test_a_full_disk_costs_cache_hits_not_answers(tiny_model, small_disk):
    reference = EmberServer(tiny_model, *ARGS)
    try:
        want = {i: httpx.post(f"{reference.url}/v1/completions", json=dict(BODY, prompt=p),
                              timeout=60).json()["choices"][0]["text"]
                for i, p in enumerate(PROMPTS)}  # fmt: skip
    finally:
        reference.stop()
    # a pool of 48 blocks (4 KiB each): two prompts of 160 tokens and their answers
    worker = EmberServer(tiny_model, *ARGS, "--kv-cache-memory", str(48 * 4096),
                         "--kv-disk-dir", str(small_disk), "--kv-disk-size", "1G")  # fmt: skip
    try:
        stop, lock = threading.Event(), threading.Lock()
        seen = {"requests": 0, "wrong or failed": 0, "cached tokens": 0}

        def load(index: int) -> None:
            turn = 0
            with httpx.Client(timeout=60) as client:
                while not stop.is_set():
                    # every other turn one of 4 hot prompts (80 blocks: they stay on the
                    # disk), else one of 8 cold ones (160 more: the disk fills up)
                    which = (index + turn // 2) % 4 if turn % 2 == 0 else 4 + (index + turn) % 8
                    turn += 1
                    try:
                        reply = client.post(f"{worker.url}/v1/completions",
                                            json=dict(BODY, prompt=PROMPTS[which]))  # fmt: skip
                        ok = (
                            reply.status_code == 200
                            and reply.json()["choices"][0]["text"] == want[which]
                        )
                        cached = (
                            reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                            if ok
                            else 0
                        )
                    except httpx.HTTPError:
                        ok, cached = False, 0
                    with lock:
                        seen["requests"] += 1
                        seen["wrong or failed"] += not ok
                        seen["cached tokens"] += cached

        tiers = {}

        def fill_then_free() -> None:
            time.sleep(SECONDS / 3)
            tiers["before"] = worker.load()["kv_tiers"]["disk"]
            tiers["filler bytes"] = _fill(small_disk, SECONDS / 3)
            tiers["full"] = worker.load()["kv_tiers"]["disk"]
            (small_disk / "filler").unlink()

        run_for(
            SECONDS, stop, fill_then_free, *[functools.partial(load, i) for i in range(CLIENTS)]
        )
        disk = worker.wait_idle()["kv_tiers"]["disk"]
        report("full disk", {**seen, "disk hits": disk["hits"], "disk writes": disk["writes"],
                             "failed writes": disk["write_errors"],
                             "filler MiB": round(tiers["filler bytes"] / 2**20, 2)})  # fmt: skip
        assert seen["wrong or failed"] == 0 and seen["requests"] > 0
        # the tier served from the disk it filled itself, and again after the filler had
        # taken it all and was gone
        assert tiers["filler bytes"] > 2**19 and tiers["full"]["write_errors"] > 0
        assert 0 < tiers["before"]["hits"] <= tiers["full"]["hits"] < disk["hits"]
        assert tiers["full"]["writes"] < disk["writes"]
        assert worker.process.poll() is None and worker.wait_idle()["kv_blocks_used"] == 0
    finally:
        worker.stop()
