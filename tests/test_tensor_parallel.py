"""Tensor parallelism (ember.distributed): one model over 2-4 processes gives the
single-process result (logprobs within 1e-4, the same greedy tokens) with chunked
prefill, prefix-cache hits and preemption; each rank holds about 1/N of the weights and
reads only its part of the checkpoint; a rank that dies ends the engine with a clear
error and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from ember.config import EngineConfig
from ember.distributed import shm_comm
from ember.distributed.executor import RankFailedError
from ember.distributed.parallel import HeadSplit, head_split, split
from ember.models.layers import Linear

pytestmark = pytest.mark.skipif(not shm_comm.ORDERED_STORES, reason="x86-64 ranks")

LOGPROB_TOLERANCE = 1e-4
PROMPTS = [
    [(5 * i + 3) % 500 + 3 for i in range(7)],
    [(11 * i + 1) % 500 + 3 for i in range(61)],  # 4 chunks of 16 under the small budget
    [(3 * i + 7) % 500 + 3 for i in range(33)],
]


def _run(path, prompts=PROMPTS, max_tokens=12, **options):
    """Greedy tokens and (generated, prompt) logprobs of `prompts`, then the engine's
    scheduler counters; the engine is closed after."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=3, prompt_logprobs=3)
    with LLM(str(path), kv_cache_memory=options.pop("kv_cache_memory", 8 << 20), **options) as llm:
        outputs = llm.generate(prompts, params)
        # the second prompt again, from the prefix cache (prompt logprobs would compute it)
        again = llm.generate(prompts[1:2], SamplingParams(max_tokens=max_tokens, temperature=0))
        scheduler = llm.engine.core.scheduler
        counters = (scheduler.num_preemptions, again[0].num_cached_tokens)
    return outputs + again, counters


def _assert_same(single, parallel) -> None:
    worst = 0.0
    for a, b in zip(single, parallel, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        pairs = list(zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True))
        pairs += list(zip(a.prompt_logprobs or [None], b.prompt_logprobs or [None], strict=True))[
            1:
        ]
        for x, y in pairs:
            assert x.keys() == y.keys()
            worst = max(worst, *(abs(x[k] - y[k]) for k in x))
    assert worst < LOGPROB_TOLERANCE


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_ranks_give_the_single_process_result(tiny_checkpoint, arch: str) -> None:
    """Two ranks of Llama (tied head), Qwen2 (qkv bias), Qwen3 (q/k norm), prompts in
    chunks of 16 tokens, a prompt again from the prefix cache."""
    assert_like_one_process(tiny_checkpoint(arch), tensor_parallel_size=2)


def assert_like_one_process(path, **options) -> None:
    """`options` (ranks) give one process's result, prompts in chunks of 16, the second
    prompt again from the prefix cache."""
    single, (_, cached) = _run(path, max_num_batched_tokens=16)
    parallel, (_, cached_n) = _run(path, max_num_batched_tokens=16, **options)
    _assert_same(single, parallel)
    assert cached == cached_n == 48  # 3 of the 61-token prompt's blocks


@pytest.mark.parametrize(
    "ranks, share",
    [
        # 4 ranks of a model with 2 KV heads: each KV head on two ranks
        (dict(tensor_parallel_size=4), 2),
        # 2 pipeline stages of 2 ranks: a rank one layer of two and one KV head of two;
        # preempting only while no other step is in flight
        (dict(tensor_parallel_size=2, pipeline_parallel_size=2), 4),
    ],
)
def test_ranks_survive_preemption(tiny_checkpoint, ranks: dict, share: int) -> None:
    """A pool too small for the batch preempts sequences and recomputes them, and the
    result is one rank's."""
    path = tiny_checkpoint("llama")
    block_bytes = 2 * 16 * 2 * 2 * 16 * 4  # layers x tokens x (k, v) x KV heads x dim x fp32
    blocks = 7  # of the 12 the three sequences need at once
    # no step budget: its chunk sizes follow measured step times, and preemptions with them
    # arrival order, whose first prompt takes the blocks the others then preempt it for
    # (shortest first admits the short ones, and the long one waits for their blocks)
    options = dict(max_tokens=24, max_model_len=96, max_step_ms=0, scheduling_policy="fcfs")
    single, (preempted, _) = _run(path, kv_cache_memory=blocks * block_bytes, **options)
    # kv_cache_memory is per rank: `share` of a block's bytes are on each
    parallel, (preempted_n, _) = _run(
        path, kv_cache_memory=blocks * block_bytes // share, **ranks, **options
    )
    assert preempted > 0 and preempted_n > 0
    if "pipeline_parallel_size" not in ranks:  # one step at a time: the same choices
        assert preempted_n == preempted
    _assert_same(single, parallel)


def test_each_rank_holds_its_share_of_the_weights(tiny_checkpoint) -> None:
    path = tiny_checkpoint("mistral")
    with LLM(str(path), kv_cache_memory=8 << 20) as llm:
        whole = llm.engine.core.runner.weight_bytes()
    with LLM(str(path), kv_cache_memory=8 << 20, tensor_parallel_size=2) as llm:
        runner = llm.engine.core.runner
        ranks = [runner.weight_bytes(), *runner.executor.rank_weight_bytes]
        shapes = {n: tuple(p.shape) for n, p in runner.model.named_parameters()}
    for share in ranks:
        assert 0.45 * whole < share < 0.55 * whole  # norms (replicated) are tiny
    assert shapes["model.embed_tokens.weight"] == (256, 64)
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (32 + 16 + 16, 64)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 64)


def test_a_rank_reads_only_its_part_of_each_tensor(tiny_checkpoint) -> None:
    """Checkpoint.weights(narrow) hands out the narrowed slices, not whole tensors."""
    from ember.loader.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(tiny_checkpoint("llama"))
    whole = dict(checkpoint.weights())

    def narrow(name):
        return (1, 16, 32) if name.endswith("o_proj.weight") else (0, 8, 8)

    for name, tensor in checkpoint.weights(narrow):
        dim, start, length = narrow(name)
        assert torch.equal(tensor, whole[name].narrow(dim, start, length))


@pytest.mark.parametrize("case", ["llama-Q4_1", "llama-k-quants", "qwen2-Q4_0", "llama-Q8_0-tied"])
def test_gguf_ranks_decode_from_their_blocks(tmp_path: Path, case: str) -> None:
    """A GGUF file over two ranks: each dequantizes only its rows (llama's q/k rows put
    back in order per head) and decodes from its part of the blocks, where the part's
    columns fall on block boundaries (not a K-quant down projection's 128 of 256)."""
    from test_gguf_loader import BLOCK_CASES, write_tiny_model

    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, **BLOCK_CASES[case])
    prompts = [p[:20] for p in PROMPTS]
    single, _ = _run(path, prompts, max_tokens=16)
    with LLM(str(path), kv_cache_memory=8 << 20, tensor_parallel_size=2) as llm:
        model = llm.engine.core.runner.model.inner
        blocks = {
            n for n, m in model.named_modules() if isinstance(m, Linear) and m.blocks is not None
        }
    assert ("model.layers.0.mlp.down_proj" in blocks) == (case != "llama-k-quants")
    assert "model.layers.0.self_attn.qkv_proj" in blocks
    parallel, _ = _run(path, prompts, max_tokens=16, tensor_parallel_size=2)
    _assert_same(single, parallel)


def test_head_split() -> None:
    assert [split(10, 3, r) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]
    # SmolLM2: 9 query heads over 3 KV heads, on 2 ranks: 2 KV heads and 1
    assert head_split(9, 3, 2, 0) == HeadSplit(0, 6, 0, 2)
    assert head_split(9, 3, 2, 1) == HeadSplit(6, 3, 2, 1)
    # more ranks than KV heads: each KV head on two ranks, its query heads split
    assert [head_split(8, 2, 4, r) for r in range(4)] == [
        HeadSplit(0, 2, 0, 1), HeadSplit(2, 2, 0, 1), HeadSplit(4, 2, 1, 1), HeadSplit(6, 2, 1, 1),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        head_split(8, 2, 3, 0)


@pytest.mark.parametrize(
    "options, named",
    [
        (dict(speculative_method="mtp"), "speculative_method 'mtp'"),
        (dict(tensor_parallel_size=0), None),
    ],
)
def test_what_one_rank_only_does_is_refused(options: dict, named: str | None) -> None:
    options.setdefault("tensor_parallel_size", 2)
    with pytest.raises(ValueError, match="tensor_parallel_size") as error:
        EngineConfig(**options)
    assert named is None or named in str(error.value)


def test_models_that_do_not_split_are_refused_before_ranks_start(tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match="cannot be shared evenly by 3 ranks"):
        LLM(str(tiny_checkpoint("llama")), kv_cache_memory=8 << 20, tensor_parallel_size=3)
    assert not _rank_processes()


def _rank_processes() -> list[int]:
    """Pids of this process's rank workers still alive."""
    out = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "ember.distributed.rank_worker"],
                         capture_output=True, text=True)  # fmt: skip
    return [int(pid) for pid in out.stdout.split()]


def test_a_dead_rank_fails_the_engine_cleanly(tiny_checkpoint) -> None:
    """Killing rank 1 mid-service: the next step raises RankFailedError naming the rank,
    the other ranks are stopped, nothing is left in /dev/shm."""
    llm = LLM(str(tiny_checkpoint("llama")), kv_cache_memory=8 << 20, tensor_parallel_size=4)
    params = SamplingParams(max_tokens=4, temperature=0)
    assert len(llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids) == 4
    pids = _rank_processes()
    assert len(pids) == 3
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RankFailedError, match=r"rank \d of 4 exited \(code -9\)"):
        llm.generate(PROMPTS[:1], params)
    deadline = time.monotonic() + 10
    while _rank_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _rank_processes()
    with pytest.raises(RankFailedError):  # no half-working engine either
        llm.generate(PROMPTS[:1], params)
    llm.close()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("ember-comm")]


def test_a_rank_that_cannot_load_fails_the_start(tiny_checkpoint, monkeypatch) -> None:
    """Rank 1 fails while loading: the engine does not start, the error is that rank's,
    and no rank is left running."""
    from ember.distributed import executor

    code = (
        "import sys\n"
        "from ember.distributed import rank_worker\n"
        "from ember.loader import checkpoint\n"
        "def refuse(*args, **kwargs):\n"
        "    raise OSError('disk gone')\n"
        "checkpoint.Checkpoint.weights = refuse\n"
        "sys.exit(rank_worker.main())\n"
    )
    monkeypatch.setattr(executor, "RANK_MODULE", ["-c", code])
    with pytest.raises(RankFailedError, match="rank 1 failed: OSError: disk gone"):
        LLM(str(tiny_checkpoint("llama")), kv_cache_memory=8 << 20, tensor_parallel_size=2)
    assert not _rank_processes()


def test_rank_worker_exits_with_its_parent(tmp_path: Path) -> None:
    """A rank whose rank 0 is killed does not outlive it (PR_SET_PDEATHSIG)."""
    flag = tmp_path / "armed"
    child_code = (
        "from ember.distributed import rank_worker; import time; "
        f"rank_worker._die_with_parent(); open({str(flag)!r}, 'w').close(); time.sleep(60)"
    )
    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child_code!r}])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 30
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    parent.kill()
    parent.wait()
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail("the rank outlived its parent")


def test_serve_with_two_ranks_and_a_rank_killed(tiny_checkpoint) -> None:
    """`ember serve --tensor-parallel-size 2` answers as one process does; with its rank
    killed, requests get a 503 error body, /health says so, the core process and its
    rank are gone (a router then sends the sessions to its other workers); then the API
    process starts the engine and its ranks again, and it answers as before."""
    import httpx

    from server_utils import EmberServer, child_pids, pid_alive

    path = tiny_checkpoint("llama")
    with LLM(str(path), kv_cache_memory=8 << 20) as llm:
        expected = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0))
    server = EmberServer(str(path), "--tensor-parallel-size", "2", "--kv-cache-memory", "8M")
    try:
        body = {"model": str(path), "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
        assert reply["choices"][0]["text"] == expected[0].outputs[0].text
        (rank,) = child_pids(server.core_pid)
        os.kill(rank, signal.SIGKILL)
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 503
        assert reply.json()["error"]["message"]
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
        deadline = time.monotonic() + 10
        while pid_alive(server.core_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(server.core_pid) and not pid_alive(rank)
        deadline = time.monotonic() + 120  # the API process starts the engine and its ranks again
        while httpx.get(f"{server.url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the engine did not come back"
            time.sleep(0.2)
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
        assert reply["choices"][0]["text"] == expected[0].outputs[0].text
    finally:
        assert server.stop() == 0
    assert not child_pids(server.process.pid)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("by_expert", [True, False], ids=["expert-parallel", "within-experts"])
def test_experts_over_two_ranks_give_the_single_process_result(
    tiny_checkpoint, arch: str, by_expert: bool
) -> None:
    """Experts split over two ranks, attention split as above: the single-process result.
    Expert parallel: each rank holds 2 of Mixtral's 4 experts (4 of Qwen3-MoE's 8, whose
    other layers are dense) and reads nothing of the others'; within experts (tensor
    parallel alone, vLLM's default): every expert, half of its intermediate features."""
    from ember.models.moe import Experts

    path = tiny_checkpoint(arch)
    options = dict(tensor_parallel_size=2, expert_parallel=by_expert)
    single, _ = _run(path, max_num_batched_tokens=16)
    parallel, _ = _run(path, max_num_batched_tokens=16, **options)
    _assert_same(single, parallel)
    with LLM(str(path), kv_cache_memory=8 << 20, **options) as llm:
        runner = llm.engine.core.runner
        experts = [m for m in runner.model.modules() if isinstance(m, Experts)]
        shares = [runner.weight_bytes(), *runner.executor.rank_weight_bytes]
    assert experts
    for e in experts:
        if by_expert:
            assert e.num_local * 2 == e.num_experts == 2 * e.gate_up_proj.shape[0]
            assert e.down_proj.shape[2] == e.intermediate_size
        else:
            assert e.num_local == e.num_experts == e.gate_up_proj.shape[0]
            assert e.gate_up_proj.shape[1] == e.intermediate_size == 2 * e.down_proj.shape[2]
    with LLM(str(path), kv_cache_memory=8 << 20) as llm:
        whole = llm.engine.core.runner.weight_bytes()
    assert all(0.45 * whole < share < 0.56 * whole for share in shares)


@pytest.mark.parametrize("by_expert", [True, False], ids=["expert-parallel", "within-experts"])
def test_stacked_expert_tensors_over_two_ranks(tiny_checkpoint, tmp_path, by_expert) -> None:
    """A checkpoint in transformers' in-memory layout (each layer's experts in one
    gate_up_proj and one down_proj tensor) over two ranks: each rank takes its experts, or
    its rows of gate and of up and its columns of down; the single-process result."""
    from test_moe_mla import rewrite_checkpoint, stack_experts

    path = rewrite_checkpoint(tiny_checkpoint("deepseek_v3"), tmp_path / "stacked", stack_experts)
    single, _ = _run(path, max_num_batched_tokens=16)
    parallel, _ = _run(
        path, max_num_batched_tokens=16, tensor_parallel_size=2, expert_parallel=by_expert
    )
    _assert_same(single, parallel)


def test_expert_load_per_rank_in_metrics(tiny_checkpoint) -> None:
    """`ember serve -tp 2 --expert-parallel`: /metrics has each rank's experts' tokens."""
    import httpx

    from server_utils import EmberServer, moe_samples

    server = EmberServer(
        str(tiny_checkpoint("qwen3_moe")),
        "-tp",
        "2",
        "--expert-parallel",
        "--kv-cache-memory",
        "8M",
    )
    try:
        body = {"prompt": list(range(10, 40)), "max_tokens": 6, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        samples = moe_samples(server.url, "ember_moe_rank_tokens")
    finally:
        server.stop()
    ranks = {s.labels["rank"]: s.value for s in samples if s.name == "ember_moe_rank_tokens"}
    experts = {
        int(s.labels["expert"]): s.value for s in samples if s.name == "ember_moe_expert_tokens"
    }
    assert ranks == {
        "0": sum(experts[e] for e in range(4)),
        "1": sum(experts[e] for e in range(4, 8)),
    }
    assert sum(ranks.values()) == (30 + 6 - 1) * 2


@pytest.mark.parametrize("per_expert", [False, True])
@pytest.mark.parametrize("by_expert", [True, False], ids=["expert-parallel", "within-experts"])
def test_experts_over_two_ranks_from_a_gguf_file(
    tiny_checkpoint, tmp_path: Path, per_expert, by_expert
) -> None:
    """A Q8_0 Mixtral GGUF file (experts stacked per projection, or one tensor each) over
    two ranks: each dequantizes and decodes from the blocks of its own experts only (expert
    parallel), or of its rows of every expert's gate and up and its columns of down (within
    experts: 64 of 128 features, two whole Q8_0 blocks per row); the single process's
    tokens."""
    from gguf_convert import QT, write_gguf
    from transformers import AutoModelForCausalLM

    from ember.models.moe import Experts

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("mixtral"))
    path = write_gguf(model, "mixtral", tmp_path / "m.gguf", qtype=QT.Q8_0, per_expert=per_expert)
    prompts = [p[:20] for p in PROMPTS]
    single, _ = _run(path, prompts, max_tokens=16)
    options = dict(tensor_parallel_size=2, expert_parallel=by_expert)
    parallel, _ = _run(path, prompts, max_tokens=16, **options)
    _assert_same(single, parallel)
    with LLM(str(path), kv_cache_memory=8 << 20, **options) as llm:
        experts = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, Experts)]
    assert experts
    for e in experts:
        gate_up, down = e.blocks["gate_up_proj"], e.blocks["down_proj"]
        assert gate_up.shape[0] == down.shape[0] == e.num_local == (2 if by_expert else 4)
        assert gate_up.shape[1] == 2 * (128 if by_expert else 64)
        assert down.shape[2] == (4 if by_expert else 2)  # Q8_0 blocks of 32 per row


def test_a_model_over_its_rank_budget_is_served_by_two(tiny_checkpoint) -> None:
    """max_rank_memory below the whole model's weights and above half of them: one
    process is refused before reading a weight (the message names the ranks it needs),
    two serve it, and each rank's KV pool gets what its weights leave."""
    path = str(tiny_checkpoint("llama"))
    with LLM(path, kv_cache_memory=8 << 20) as llm:
        whole = llm.engine.core.runner.weight_bytes()
    limit = int(0.75 * whole)
    with pytest.raises(ValueError, match=r"max_rank_memory=.*tensor_parallel_size=2"):
        LLM(path, max_rank_memory=limit, max_model_len=256)
    with LLM(path, max_rank_memory=limit, max_model_len=256, tensor_parallel_size=2) as llm:
        runner = llm.engine.core.runner
        assert runner.weight_bytes() < 0.55 * whole
        assert llm.engine.core.kv_cache.num_blocks == (limit - runner.weight_bytes()) // 4096
        out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "arch, by_expert", [("deepseek_v3", True), ("deepseek_v3_plain", True), ("deepseek_v3", False)]
)
def test_latent_attention_over_two_ranks(tiny_checkpoint, arch: str, by_expert: bool) -> None:
    """DeepSeek-V3's MLA (q through a LoRA or not) with its heads split over two ranks
    and its experts too (by expert, or within each with the shared expert): the
    single-process result. Each rank caches the whole latent (a block takes as many
    bytes as on one rank) and holds half the heads' rows."""
    path = tiny_checkpoint(arch)
    with LLM(str(path), kv_cache_memory=8 << 20) as llm:
        block_bytes = llm.engine.core.runner.kv_block_bytes
    single, _ = _run(path, max_num_batched_tokens=16)
    options = dict(tensor_parallel_size=2, expert_parallel=by_expert)
    with LLM(str(path), kv_cache_memory=8 << 20, **options) as llm:
        runner = llm.engine.core.runner
        assert runner.kv_block_bytes == block_bytes == runner.executor.rank_block_bytes[0]
        attn = runner.model.model.layers[0].self_attn
        assert attn.num_heads == 2 and attn.kv_b_proj.weight.shape == (2 * (16 + 12), 16)
    parallel, _ = _run(path, max_num_batched_tokens=16, **options)
    _assert_same(single, parallel)
