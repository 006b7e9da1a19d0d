"""What a start costs: the KV pool takes no memory until requests use it (privately or in
the shared-memory file of a prefill worker) or the engine, idle, takes its pages ahead of
use, and the API process of `ember serve` loads no torch. (`test_bench_startup.py` times a real start, phase by phase.)"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import torch

from ember import startup
from ember.config import EngineConfig
from ember.engine import core_client
from ember.engine.core import EngineCore
from ember.engine.messages import EngineCoreRequest
from ember.kv import buffers
from ember.models import huge_pages
from ember.sampling_params import SamplingParams
from server_utils import EmberServer

PAGE = os.sysconf("SC_PAGE_SIZE")
POOL_BYTES = 256 << 20

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/pagemap"), reason="reads /proc/self/pagemap (Linux)"
)


def resident_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the tensors' memory that is mapped into this process (present pages, from
    /proc/self/pagemap: bit 63 of each page's entry, readable without privileges)."""
    start = min(t.data_ptr() for t in tensors)
    end = max(t.data_ptr() + t.numel() * t.element_size() for t in tensors)
    first, last = start // PAGE, -(-end // PAGE)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = memoryview(f.read((last - first) * 8)).cast("Q")
    return sum(PAGE for entry in entries if entry >> 63)


def kv_shape(num_blocks: int) -> tuple[int, ...]:
    return (2, num_blocks, 16, 2, 64)  # 16 KiB a block and layer (keys, values)


@pytest.mark.parametrize("shm, huge", [(False, "1"), (False, "0"), (True, "1")])
def test_a_new_pool_holds_no_memory_until_a_block_is_written(shm, huge, monkeypatch):
    """Untouched, a pool holds no memory; a block written takes the pages under it: a 2 MB
    page or two where the anonymous pool is advised onto them (EMBER_HUGE_PAGES, Linux:
    it then starts on a 2 MB boundary), a few 4 KB ones otherwise (the /dev/shm file)."""
    monkeypatch.setenv("EMBER_HUGE_PAGES", huge)
    layers, path = buffers.allocate(kv_shape(2048), 8, torch.float32, "cpu", shm=shm)
    try:
        total = sum(t.numel() * t.element_size() for t in layers)
        assert total == POOL_BYTES
        assert resident_bytes(layers) == 0
        if path is not None:  # nor in the file that decode workers map
            assert os.stat(path).st_blocks == 0
        advised = not shm and huge_pages.applies()
        assert (layers[0].data_ptr() % huge_pages.HUGE_PAGE == 0) or not advised

        layers[3][1, 7].fill_(1.0)  # one block's values in one layer: 8 KiB, two pages
        limit = 2 * huge_pages.HUGE_PAGE if advised else 4 * PAGE
        assert 0 < resident_bytes(layers) <= limit
        assert float(layers[3][1, 7].sum()) == 16 * 2 * 64
        assert float(layers[5].abs().sum()) == 0.0  # untouched memory reads as zeros
    finally:
        buffers.remove_shm(path)


@pytest.mark.parametrize("role", ["mixed", "prefill"])  # prefill: the pool is a /dev/shm file
def test_an_engine_starts_without_touching_its_pool_and_still_generates(
    tiny_checkpoint, monkeypatch, role
):
    monkeypatch.setenv("EMBER_CLUSTER_SECRET", "test-secret")
    config = EngineConfig(
        model=str(tiny_checkpoint("llama")),
        kv_cache_memory=POOL_BYTES,
        max_model_len=256,
        kv_role=role,
        device="cpu",
    )
    core = EngineCore.from_config(config)
    try:
        kv = core.runner.kv_caches
        pool = sum(t.numel() * t.element_size() for t in kv)
        assert pool >= POOL_BYTES * 0.9
        assert resident_bytes(kv) == 0
        shm_path = core.runner.kv_shm_path
        assert (shm_path is not None) == (role == "prefill")
        if shm_path is not None:
            assert os.stat(shm_path).st_blocks == 0

        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        core.add_request(EngineCoreRequest("a", list(range(5, 45)), params, 8, []))
        outputs = []
        while core.has_unfinished():
            outputs += core.step()
        assert len([t for o in outputs for t in o.new_token_ids]) == 8
        # the blocks of 48 tokens, in every layer: 4 KB pages, the pool's first ones left
        # on them where the rest is advised onto 2 MB pages (Prefaulter's small_heads)
        assert 0 < resident_bytes(kv) <= pool / 100
    finally:
        core.close()


@pytest.mark.parametrize("shm", [False, True])
@pytest.mark.parametrize("madvise", [True, False])  # False: the page-touching fallback
def test_the_prefaulter_takes_every_page_and_changes_no_byte(shm, madvise, monkeypatch):
    # 4 KB pages, so that the pool's residency follows the slices (2 MB ones hold 256 of
    # these blocks each: the test above)
    monkeypatch.setenv("EMBER_HUGE_PAGES", "0")
    layers, path = buffers.allocate(kv_shape(512), 4, torch.float32, "cpu", shm=shm)
    try:

        def write(tensors):
            tensors[1][0, 3].fill_(-0.0)  # bytes an add of zero would change
            tensors[2][1, 200].fill_(float("nan"))
            tensors[3][0, 511, 15, 1].copy_(torch.arange(64.0))

        write(layers)  # (no read of the rest: a read maps the zero page, "resident")
        # 8 parts (4 layers' keys and values), 8 KiB of each a block: ranges of 100 blocks,
        # one piece a step (no time to spare)
        prefaulter = buffers.Prefaulter(layers, range_bytes=100 * 8 << 10, slice_seconds=0)
        if not madvise:
            prefaulter._madvise = None
        assert prefaulter.blocks_per_range == 100 and not prefaulter.done
        steps, resident = 0, 0
        while prefaulter.step():
            steps += 1
            now = resident_bytes(layers)
            assert resident < now < sum(t.nbytes for t in layers)  # a piece a step
            resident = now
        assert steps + 1 == 6 * 8 and prefaulter.done and not prefaulter.step()  # 512 / 100
        assert resident_bytes(layers) == sum(t.nbytes for t in layers)
        expected = [torch.zeros_like(t) for t in layers]
        write(expected)
        for now, then in zip(layers, expected, strict=True):
            assert torch.equal(now.view(torch.int32), then.view(torch.int32))
    finally:
        buffers.remove_shm(path)


def test_an_idle_engine_takes_its_pool_ahead_of_use_and_generates_the_same(tiny_checkpoint):
    config = EngineConfig(
        model=str(tiny_checkpoint("llama")), kv_cache_memory=POOL_BYTES, max_model_len=256
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for prefault in (False, True):
        core = EngineCore.from_config(config)
        try:
            kv = core.runner.kv_caches
            assert core.has_idle_work()
            while prefault and core.has_idle_work():
                core.idle_work()
            pool = sum(t.nbytes for t in kv)
            assert (resident_bytes(kv) == pool) == prefault
            core.add_request(EngineCoreRequest("a", list(range(5, 45)), params, 8, []))
            outputs = []
            while core.has_unfinished():
                outputs += core.step()
            tokens[prefault] = [t for o in outputs for t in o.new_token_ids]
        finally:
            core.close()
    assert len(tokens[True]) == 8 and tokens[True] == tokens[False]


def vm_flags(address: int) -> set[str]:
    """The kernel's flags for the mapping holding `address` (/proc/self/smaps): "hg" for
    MADV_HUGEPAGE, "nh" for MADV_NOHUGEPAGE."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not huge_pages.applies(), reason="2 MB pages are not advised here")
@pytest.mark.parametrize("collapse", [True, False])  # False: a kernel without MADV_COLLAPSE
def test_a_huge_page_pool_keeps_its_heads_on_small_pages_until_it_has_every_page(collapse):
    """A pool advised onto 2 MB pages: the 2 MB regions holding each part's first range
    go onto 4 KB pages (a first request's writes take a few of them, not a 2 MB page a
    part), and are advised back onto 2 MB ones (and collapsed, where the kernel can) once
    the prefaulter has taken every page, with every byte as it was."""
    layers, _ = buffers.allocate(kv_shape(1024), 3, torch.float32, "cpu", shm=False)
    part_bytes = layers[0][0].nbytes  # 8 MB: the heads are 2 MB regions apart
    prefaulter = buffers.Prefaulter(layers, slice_seconds=0, small_heads=True)
    if not collapse:
        madvise = prefaulter._libc_madvise
        prefaulter._libc_madvise = lambda *a: -1 if a[2] == buffers.MADV_COLLAPSE else madvise(*a)
    starts = [part.data_ptr() for layer in layers for part in layer]
    assert [start for start, _ in prefaulter.heads] == starts and part_bytes == 8 << 20
    assert all(length == huge_pages.HUGE_PAGE for _, length in prefaulter.heads)
    assert all("nh" in vm_flags(start) for start in starts)
    assert "hg" in vm_flags(starts[0] + huge_pages.HUGE_PAGE)  # past the head
    layers[0][0, 0].fill_(1.5)  # the first block, a head's (before its pages are taken)
    layers[2][1, 1023].fill_(-2.0)  # the last, past every head
    assert resident_bytes([layers[0][0, :128]]) == 2 * PAGE  # 8 KiB: the block's own pages
    steps = 0
    while prefaulter.step():
        steps += 1
    assert prefaulter.done and steps >= len(starts) * 4  # 2 MB pieces, then the heads
    assert all("hg" in vm_flags(start) and "nh" not in vm_flags(start) for start in starts)
    assert resident_bytes(layers) == sum(t.nbytes for t in layers)
    assert float(layers[0][0, 0].sum()) == 1.5 * layers[0][0, 0].numel()
    assert float(layers[2][1, 1023].sum()) == -2.0 * layers[2][1, 1023].numel()
    assert float(layers[1].abs().sum()) == 0.0


def test_a_prefaulter_step_takes_pieces_until_its_time_is_spent(monkeypatch):
    monkeypatch.setenv("EMBER_HUGE_PAGES", "0")
    layers, _ = buffers.allocate(kv_shape(512), 4, torch.float32, "cpu", shm=False)
    clock = iter(range(1000))  # each look at the clock: one second later
    monkeypatch.setattr(buffers.time, "perf_counter", lambda: float(next(clock)))
    prefaulter = buffers.Prefaulter(layers, range_bytes=100 * 8 << 10, slice_seconds=3)
    prefaulter.step()  # the deadline at 3: pieces end at 1, 2, 3
    assert (prefaulter.next_block, prefaulter.next_part) == (0, 3)
    assert resident_bytes(layers) == 3 * 100 * (8 << 10)
    prefaulter.slice_seconds = 100
    assert not prefaulter.step() and prefaulter.done  # all 45 pieces left, in one step
    assert resident_bytes(layers) == sum(t.nbytes for t in layers)


def rss_anon_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["RssAnon"].split()[0]) * 1024


def test_an_idle_server_core_takes_its_pool_and_then_serves(tiny_checkpoint):
    """The core process's loop does the idle work: a 1 GiB pool, several times the
    process's own memory, becomes resident without a request, and requests still run."""
    server = EmberServer(str(tiny_checkpoint("llama")), "--kv-cache-memory", "1G")
    try:
        deadline = time.monotonic() + 60
        while rss_anon_bytes(server.core_pid) < 1 << 30 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rss_anon_bytes(server.core_pid) >= 1 << 30
        body = {"model": str(tiny_checkpoint("llama")), "prompt": [5, 6, 7], "max_tokens": 4}
        body |= {"ignore_eos": True}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        assert server.stop() == 0


API_IMPORTS = textwrap.dedent(
    """
    import sys
    loaded = lambda *names: sorted(m for m in names if m in sys.modules)
    from ember import cli
    cli.build_parser().parse_args(["serve"])
    import ember.server.run  # what runs before the core is spawned
    print(loaded("torch", "fastapi", "uvicorn", "pydantic", "transformers", "httpx"))
    import ember.server.http_server
    from ember.loader.checkpoint import open_checkpoint
    tokenizer = open_checkpoint(sys.argv[1]).tokenizer()
    tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    print(loaded("torch", "safetensors"))
    """
)


def test_the_api_process_loads_no_torch_and_spawns_the_core_first(tiny_checkpoint):
    """Its imports, flags and tokenizer: torch's second of import belongs to the core,
    and the HTTP stack is imported only after the core is on its way."""
    out = subprocess.run(
        [sys.executable, "-c", API_IMPORTS, str(tiny_checkpoint("llama"))],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip().splitlines()[-2:] == ["[]", "[]"]


def test_weights_are_read_through_a_mapping_made_again_every_window(tiny_checkpoint, monkeypatch):
    """A file's pages count in resident memory while a mapping that touched them lasts:
    the loader maps a checkpoint file anew every MAPPED_BYTES, yet yields each tensor
    once, in order, and the model is the same."""
    import safetensors

    from ember import LLM
    from ember.loader import checkpoint as checkpoint_module

    path = tiny_checkpoint("deepseek_v3")
    file = path / "model.safetensors"
    with safetensors.safe_open(str(file), framework="pt") as f:
        expected = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    opened = []
    real_open = safetensors.safe_open

    def counting_open(*args, **kwargs):
        opened.append(args[0])
        return real_open(*args, **kwargs)

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    whole = LLM(str(path), kv_cache_memory=1 << 24).generate([[5, 6, 7, 8]], greedy)
    monkeypatch.setattr(checkpoint_module, "MAPPED_BYTES", 16 << 10)
    monkeypatch.setattr(safetensors, "safe_open", counting_open)
    got = list(checkpoint_module.open_checkpoint(path).weights())
    assert [name for name, _ in got] == list(expected)
    assert all(torch.equal(tensor, expected[name]) for name, tensor in got)
    total = sum(t.nbytes for t in expected.values())
    assert len(opened) >= total // (16 << 10) // 2  # many windows, not one mapping
    windowed = LLM(str(path), kv_cache_memory=1 << 24).generate([[5, 6, 7, 8]], greedy)
    assert windowed[0].outputs[0].token_ids == whole[0].outputs[0].token_ids


def _processes_with(needle: str) -> list[int]:
    """Live processes whose command line holds `needle`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if entry.name.isdigit() and needle.encode() in cmdline:
            found.append(int(entry.name))
    return found


def test_ember_serve_starts_its_core_before_it_reads_its_flags(tiny_checkpoint):
    server = EmberServer(str(tiny_checkpoint("llama")))
    try:
        phases = {}
        for line in httpx.get(f"{server.url}/metrics", timeout=5).text.splitlines():
            if line.startswith("ember_startup_seconds{"):
                labels, value = line[len("ember_startup_seconds{") :].split("} ")
                fields = dict(part.split("=") for part in labels.split(","))
                phases[fields["process"].strip('"'), fields["phase"].strip('"')] = float(value)
        assert phases["core", "start"] < phases["api", "args"] < phases["api", "core configured"]
        body = {"model": str(tiny_checkpoint("llama")), "prompt": [5, 6, 7], "max_tokens": 2}
        reply = httpx.post(f"{server.url}/v1/completions", json=body | {"ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("flag", ["--engine-restarts=-1", "--no-such-flag"])
def test_flags_that_fail_stop_the_core_started_before_them(tiny_checkpoint, flag):
    """A flag refused by its check (a ValueError) or by the parser (argparse's exit):
    exit code 2 naming it, and the core started ahead of the flags is gone with the API
    process, its sockets too (both named by the API process's pid)."""
    api = subprocess.Popen(
        [sys.executable, "-m", "ember.cli", "serve", str(tiny_checkpoint("llama")), flag],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = api.communicate(timeout=120)
    assert api.returncode == 2
    assert flag.split("=")[0] in stderr
    ours = f"{core_client.SOCKET_DIR_PREFIX}{api.pid}-"
    assert _processes_with(ours) == []
    assert [p for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(ours)] == []


def test_a_core_whose_frontend_gives_no_config_exits_quietly():
    done = subprocess.run(
        [sys.executable, "-m", "ember.engine.core_proc", "--config", "-",
         "--input", "ipc:///nonexistent/in", "--output", "ipc:///nonexistent/out"],
        input=b"",
        capture_output=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    assert b"Traceback" not in done.stderr


def test_a_core_started_ahead_serves_once_given_its_config(tiny_checkpoint):
    from ember.engine.async_llm import AsyncLLM

    client = core_client.EngineCoreClient(None)
    assert client.config is None
    client.start(EngineConfig(model=str(tiny_checkpoint("llama")), kv_cache_memory=1 << 24))
    with pytest.raises(RuntimeError, match="has its config already"):
        client.start(client.config)
    llm = AsyncLLM(core=client, wait=False)  # the tokenizer before the core is ready
    try:
        assert llm.tokenizer is not None and llm.input_processor.max_model_len == 0
        llm.connect()
        assert llm.max_model_len == llm.input_processor.max_model_len > 0
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

        async def run():
            async for output in llm.generate([5, 6, 7], params):
                last = output
            return last

        assert len(asyncio.run(run()).outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
    assert client.process.poll() is not None


def test_a_frontend_shut_down_before_its_core_was_ready_leaves_nothing(tiny_checkpoint):
    from ember.engine.async_llm import AsyncLLM

    llm = AsyncLLM(str(tiny_checkpoint("llama")), wait=False, kv_cache_memory=1 << 24)
    started = time.monotonic()
    llm.shutdown()
    assert llm.client.process.poll() is not None and time.monotonic() - started < 30
    assert not os.path.exists(llm.client._dir)
    unstarted = core_client.EngineCoreClient(None)
    unstarted.shutdown()  # killed at once: it has no config to wind down
    assert unstarted.process.poll() is not None


def test_the_collector_is_on_after_a_start_and_skips_what_the_start_made():
    import gc

    startup.hold_collector()
    try:
        assert not gc.isenabled()
        kept = [[] for _ in range(1000)]
    finally:
        startup.release_collector()
    try:
        assert gc.isenabled() and gc.get_freeze_count() >= len(kept)
    finally:
        gc.unfreeze()
