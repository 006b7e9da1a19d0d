"""Fixtures: tiny random checkpoints (transformers' config classes) with a tiny tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ember.config import EngineConfig

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the suite checks exact fp32 (token for token with transformers in fp32) unless a test
# names a precision; the engines of child processes (`ember serve`, `ember up`, AsyncLLM's
# engine core) read the default from here too
os.environ["EMBER_MATMUL_PRECISION"] = "ieee"
torch.set_num_threads(min(2, os.cpu_count() or 1))

VOCAB = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Agents resend their whole context every turn, so prefill and cache reuse dominate. ",
    "def main():\n    print('hello, world')\n    return 0\n",
    "Größe, naïve café, 東京, emoji 🙂 and more unicode text here. ",
    "0123456789 " * 5,
]

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.25,
    bos_token_id=None,
    eos_token_id=1,
    pad_token_id=None,
)


# DeepSeek-V3's shapes scaled down: MLA (q through a LoRA, interleaved rotary pairs,
# YaRN with mscale), 8 routed experts in 2 groups of which a token picks from 1, a shared
# expert, a dense first layer; "deepseek_v3_plain": q in one projection, rotate-half
# rotary, plain rope, 4 groups of which 2, no weight normalization
DEEPSEEK = dict(
    COMMON,
    num_hidden_layers=3,
    num_key_value_heads=4,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)


def _configs():
    from transformers import (
        DeepseekV3Config,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    plain = dict(DEEPSEEK, q_lora_rank=None, rope_interleave=False, n_group=4, topk_group=2)
    plain.update(norm_topk_prob=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return {
        "deepseek_v3": DeepseekV3Config(**DEEPSEEK),
        "deepseek_v3_plain": DeepseekV3Config(**plain),
        # experts on layers 1 and 3 (every 2nd) but not 3 (mlp_only_layers): layer 1 only
        "qwen3_moe": Qwen3MoeConfig(
            **dict(COMMON, num_hidden_layers=4),
            head_dim=32,
            tie_word_embeddings=False,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            norm_topk_prob=True,
        ),
        "mixtral": MixtralConfig(
            **COMMON,
            tie_word_embeddings=False,
            sliding_window=None,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),  # fmt: skip
        "llama": LlamaConfig(**COMMON, tie_word_embeddings=True),
        "llama3": LlamaConfig(
            **COMMON,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "mistral": MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=None),
        "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
    }


ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]


def build_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>", "<|im_end|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", unk_token=None, pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_checkpoint(path: Path, arch: str) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(_configs()[arch], dtype=torch.float32)
    model.save_pretrained(path)
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A function arch -> path of a tiny random checkpoint (built once per session)."""
    cache: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in cache:
            cache[arch] = build_checkpoint(tmp_path_factory.mktemp(arch), arch)
        return cache[arch]

    return get


HAS_CUDA = torch.cuda.is_available()  # read before the fixture below hides the GPU


@pytest.fixture(autouse=True)
def timings_are_never_contended(monkeypatch):
    """In this process no idle-work timing is judged contended: the suite's own threads and
    child processes share the CPU, and a backoff would end an engine's idle work before
    a test's loop sees it done (the tests of the backoff fake the CPU times and lower
    MIN_JUDGED_MS themselves)."""
    from ember.engine import calibration

    monkeypatch.setattr(calibration, "MIN_JUDGED_MS", float("inf"))


@pytest.fixture(autouse=True, scope="session")
def auto_device_is_cpu():
    """`device="auto"` means CPU in tests, also where CUDA is present: the tests not marked
    `gpu` check the exact fp32 CPU path, and the GPU tests name device="cuda". The processes
    tests start (engine cores, `ember serve`, `ember up`) see no GPU; this one keeps it."""
    resolve = EngineConfig.resolve_device
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        patch.setattr(
            EngineConfig,
            "resolve_device",
            lambda self: torch.device("cpu") if self.device == "auto" else resolve(self),
        )
        yield


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; without it they are skipped, never failed."""
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def every_draft(request, monkeypatch):
    """The adaptive mode keeps every draft its per-request budgets allow, unless the test
    is marked `plans_drafts`: tests of what drafts do run on random models, whose drafts
    seldom pay for themselves, so the plan by cost would drop most of them (the plan has
    tests of its own: tests/test_spec_planner.py)."""
    if request.node.get_closest_marker("plans_drafts") is None:
        from ember.engine.spec_planner import DraftPlanner

        monkeypatch.setattr(DraftPlanner, "plan", lambda self, num, caps, *estimates: list(caps))


@pytest.fixture
def cpu_isa(monkeypatch):
    """`cpu_isa(name)` makes engines built afterwards in this test run the `name` build of
    ember's CPU kernels (as EMBER_CPU_ISA=name would); the next test gets the default."""
    from ember.engine.kernels import selected_isa

    def use(name: str) -> None:
        monkeypatch.setenv("EMBER_CPU_ISA", name)
        selected_isa.cache_clear()

    yield use
    monkeypatch.delenv("EMBER_CPU_ISA", raising=False)
    selected_isa.cache_clear()


def simulate_cpu(monkeypatch, *, bf16=None, amx=None, bf16_fast=None, int8_fast=None) -> None:
    """Makes matmul_precision auto (ember.engine.precision) see a CPU with or without bf16
    units (`bf16`: AMX or AVX-512 BF16), AMX (`amx`, a bf16 unit itself), bf16 that
    outruns fp32 (`bf16_fast`) and int8 tiles that do (`int8_fast`); a probe left None
    keeps this machine's answer."""
    probes = {
        "cpu_has_bf16": bf16,
        "cpu_has_amx": amx,
        "cpu_bf16_outruns_fp32": bf16_fast,
        "cpu_int8_outruns_fp32": int8_fast,
    }
    for name, value in probes.items():
        if value is not None:
            monkeypatch.setattr(f"ember.engine.precision.{name}", lambda *_, v=value: v)
