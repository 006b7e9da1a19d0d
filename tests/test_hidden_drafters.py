"""Drafters that read the target's hidden states: an EAGLE-3 head (the checkpoint
format of the EAGLE authors, SGLang and vLLM) and DeepSeek-V3's multi-token-prediction
layer. Every draft they propose must equal a dense reference computed from
transformers' hidden states (so the head's paged KV, its catch-up over the target's
rows and its drafting on its own are right), and greedy output with them must equal
decoding without drafts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_speculative import SMALL, _assert_same, _prompts
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import COMMON, VOCAB, build_tokenizer
from ember import LLM, SamplingParams
from ember.config import EngineConfig
from ember.engine.sampler import position_noise

pytestmark = pytest.mark.usefixtures("every_draft")

HIDDEN, HEADS, KV_HEADS = COMMON["hidden_size"], 4, 2
HEAD_DIM = HIDDEN // HEADS
DRAFT_VOCAB = 384
EPS = 1e-6

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1),
    SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.2),
    SamplingParams(temperature=0.8, max_tokens=30, seed=5),  # random: drafts drawn
    SamplingParams(temperature=0.0, max_tokens=35, ignore_eos=True),
]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """An 8-layer Llama (EAGLE-3's default layers are then 2, 4 and 5) and its
    transformers model."""
    path = tmp_path_factory.mktemp("target8")
    torch.manual_seed(99)
    config = LlamaConfig(**dict(COMMON, num_hidden_layers=8), tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    build_tokenizer(path)
    return path, model


def write_eagle3(path, *, layers=None, draft_vocab=DRAFT_VOCAB, own_embedding=False, **extra):
    """A random EAGLE-3 head as the EAGLE authors' trainer writes it (midlayer.*, fc,
    norm, lm_head, d2t, t2d)."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(3)

    def rand(*shape, scale=0.25):
        return torch.randn(*shape, generator=g) * scale

    q, kv, mlp = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, 2 * HIDDEN
    tensors = {
        "fc.weight": rand(HIDDEN, HIDDEN * (len(layers) if layers else 3), scale=0.1),
        "norm.weight": 1 + rand(HIDDEN, scale=0.1),
        "lm_head.weight": rand(draft_vocab, HIDDEN, scale=1.0),
    }
    layer = {
        "input_layernorm.weight": 1 + rand(HIDDEN, scale=0.1),
        "hidden_norm.weight": 1 + rand(HIDDEN, scale=0.1),
        "post_attention_layernorm.weight": 1 + rand(HIDDEN, scale=0.1),
        "self_attn.q_proj.weight": rand(q, 2 * HIDDEN),
        "self_attn.k_proj.weight": rand(kv, 2 * HIDDEN),
        "self_attn.v_proj.weight": rand(kv, 2 * HIDDEN),
        "self_attn.o_proj.weight": rand(HIDDEN, q),
        "mlp.gate_proj.weight": rand(mlp, HIDDEN),
        "mlp.up_proj.weight": rand(mlp, HIDDEN),
        "mlp.down_proj.weight": rand(HIDDEN, mlp),
    }
    tensors.update({f"midlayer.{k}": v for k, v in layer.items()})
    if draft_vocab < VOCAB:
        targets = torch.randperm(VOCAB, generator=g)[:draft_vocab].sort().values
        tensors["d2t"] = targets - torch.arange(draft_vocab)
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[targets] = True
        tensors["t2d"] = t2d
    if own_embedding:
        tensors["embed_tokens.weight"] = rand(VOCAB, HIDDEN, scale=1.0)
    save_file(tensors, path / "model.safetensors")
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": mlp, "num_hidden_layers": 1,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB,
        "draft_vocab_size": draft_vocab, "rms_norm_eps": EPS, "rope_theta": 10000.0,
        "max_position_embeddings": 1024, "tie_word_embeddings": False, **extra,
    }  # fmt: skip
    if layers:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers}
    (path / "config.json").write_text(json.dumps(config))
    return path


# -- the dense reference -----------------------------------------------------------------


def rms(x, weight, eps=EPS):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half rotary of x [T, heads, d] at positions 0..T-1."""
    d = x.shape[-1]
    angles = torch.arange(len(x))[:, None].float() / theta ** (torch.arange(0, d, 2) / d)
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]  # fmt: skip
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def eagle_layer(w, embeds, hidden):
    """The head's output before its norm at every row, rows at positions 0, 1, ...,
    causal attention without any cache."""
    n = len(hidden)
    normed = rms(hidden, w["midlayer.hidden_norm.weight"])
    x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"]), normed], -1)
    p = "midlayer.self_attn."
    q = rotate((x @ w[p + "q_proj.weight"].T).view(n, HEADS, HEAD_DIM))
    k = rotate((x @ w[p + "k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM))
    v = (x @ w[p + "v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1) for t in (k, v))
    attn = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
    r = hidden + attn.transpose(0, 1).reshape(n, -1) @ w[p + "o_proj.weight"].T
    y = rms(r, w["midlayer.post_attention_layernorm.weight"])
    gate, up = y @ w["midlayer.mlp.gate_proj.weight"].T, y @ w["midlayer.mlp.up_proj.weight"].T
    return r + (F.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T


def reference_drafts(layer, logits_of, ids, embed, tokens, hidden, k, sampling) -> list[int]:
    """k drafts after `tokens`: rows (embed(t[p + 1]), hidden[p]) for the target's
    positions 0..n-2, then each draft's row with the head's previous output; a row's
    output gives logits (`logits_of`) over the tokens `ids` (None: all), and the draft is
    their argmax, or with `sampling` (temperature, seed) the draw with the noise of its
    position."""
    ids_, rows, drafts = list(tokens[1:]), hidden[: len(tokens) - 1], []
    for j in range(k):
        out = layer(embed[torch.tensor(ids_)], rows)
        logits = logits_of(out[-1])
        if sampling is None:
            best = int(logits.argmax())
        else:
            temperature, seed = sampling
            noise = position_noise(seed, len(tokens) + j, VOCAB)
            noise = noise if ids is None else noise[ids]
            best = int((torch.softmax(logits / temperature, -1) / noise).argmax())
        drafts.append(best if ids is None else int(ids[best]))
        ids_.append(drafts[-1])
        rows = torch.cat([rows, out[-1:]])
    return drafts


def eagle_reference(model, w, layers):
    fc, embed = w["fc.weight"], model.model.embed_tokens.weight
    vocab = w["lm_head.weight"].shape[0]
    ids = torch.arange(vocab) + w["d2t"] if "d2t" in w else None

    def logits_of(out):
        return rms(out, w["norm.weight"]) @ w["lm_head.weight"].T

    def drafts(tokens, k, sampling=None):
        with torch.no_grad():
            states = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
            hidden = torch.cat([states[i][0] for i in layers], -1) @ fc.T
            layer = lambda e, h: eagle_layer(w, e, h)  # noqa: E731
            return reference_drafts(layer, logits_of, ids, embed, tokens, hidden, k, sampling)

    return drafts


def record_drafts(llm) -> list[tuple[list[int], list[int], tuple | None]]:
    """(the request's tokens, its drafts, its (temperature, seed) if it samples) of every
    proposal the engine makes from now."""
    proposer, records = llm.engine.core.speculator.proposer, []
    propose = proposer.propose

    def recording(requests, num_tokens):
        out = propose(requests, num_tokens)
        for r, d in zip(requests, out, strict=True):
            p = r.sampling_params
            sampling = None if p.greedy else (p.temperature, r.seed)
            if d:
                records.append((list(r.token_ids), d, sampling))
        return out

    proposer.propose = recording
    return records


def check(llm, plain_outputs, prompts, reference):
    """Output unchanged (the seeded random request's too), every draft the
    reference's (the random request's drawn), nothing leaked."""
    records = record_drafts(llm)
    got = llm.generate(prompts, PARAMS)
    # logprobs to 1e-4: 8 layers, and rows batched otherwise than without drafts
    _assert_same(plain_outputs, got, 1e-4)
    assert len(records) > 20 and any(sampling for *_, sampling in records)
    for tokens, drafts, sampling in records:
        assert drafts == reference(tokens, len(drafts), sampling), (len(tokens), drafts)
    core = llm.engine.core
    assert core.kv_cache.check_integrity()
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
    assert not core.speculator.proposer._pending  # every request's rows let go
    return core


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill
        {"kv_cache_memory": 10 << 15, "max_model_len": 128},  # preemption: 10 blocks
    ],
)
def test_eagle3_drafts_are_the_heads_and_greedy_output_is_unchanged(target, tmp_path, options):
    path, model = target
    head = write_eagle3(tmp_path / "eagle3")
    prompts = _prompts()
    plain = LLM(str(path), **{**SMALL, **options}).generate(prompts, PARAMS)
    # float32: on CPU the head's weights are otherwise bf16, and its drafts not the reference's
    spec = dict(speculative_method="eagle3", speculative_model=str(head), num_speculative_tokens=3)
    spec.update(dtype="float32")
    llm = LLM(str(path), **{**SMALL, **options}, **spec, speculative_adaptive=False)
    reference = eagle_reference(model, load_file(head / "model.safetensors"), (2, 4, 5))
    core = check(llm, plain, prompts, reference)
    if "max_model_len" in options:
        assert core.scheduler.num_preemptions > 0
    # the same prompts again: their blocks, the head's KV in them, are prefix-cache hits
    again = check(llm, plain, prompts, reference)
    assert again.scheduler.num_preemptions > 0 or again.stats().prefix_cache_hits > 0


def test_eagle3_head_options(target, tmp_path):
    """Layers named by the head's config (one past the last: the stack's output before
    the final norm), the full vocabulary without d2t, an embedding of its own."""
    path, model = target
    head = write_eagle3(tmp_path / "own", layers=[1, 8], draft_vocab=VOCAB, own_embedding=True)
    prompts = _prompts()[:2]
    plain = LLM(str(path), **SMALL).generate(prompts, PARAMS[:2])
    llm = LLM(
        str(path), **SMALL, speculative_method="eagle3", speculative_model=str(head),
        dtype="float32",
    )  # fmt: skip
    assert llm.engine.core.speculator.proposer.head.lm_head.weight.dtype == torch.float32
    records = record_drafts(llm)
    got = llm.generate(prompts, PARAMS[:2])
    _assert_same(plain, got, 1e-4)
    w = load_file(head / "model.safetensors")

    def logits_of(out):
        return rms(out, w["norm.weight"]) @ w["lm_head.weight"].T

    for tokens, drafts, sampling in records:
        states, before_norm = _states(model, tokens)
        hidden = torch.cat([states[1][0], before_norm], -1) @ w["fc.weight"].T
        want = reference_drafts(
            lambda e, h: eagle_layer(w, e, h), logits_of, None, w["embed_tokens.weight"],
            tokens, hidden, len(drafts), sampling,
        )  # fmt: skip
        assert drafts == want
    assert len(records) > 5


def _states(model, tokens):
    """transformers' hidden states before each layer, and the stack's output before the
    final norm (what goes into it)."""
    captured = []
    hook = model.model.norm.register_forward_hook(lambda m, args, out: captured.append(args[0]))
    try:
        with torch.no_grad():
            states = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return states, captured[0][0]


def test_bad_eagle3_heads_are_refused_by_name(target, tmp_path, tiny_checkpoint):
    path, _ = target
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(speculative_method="eagle3")
    with pytest.raises(ValueError, match="is not an EAGLE-3 head"):
        LLM(str(path), **SMALL, speculative_method="eagle3",
            speculative_model=str(tiny_checkpoint("llama")))  # fmt: skip
    wrong = write_eagle3(tmp_path / "wrong", layers=[2, 9])
    with pytest.raises(ValueError, match=r"reads layers \[2, 9\]"):
        LLM(str(path), **SMALL, speculative_method="eagle3", speculative_model=str(wrong))
    variant = write_eagle3(tmp_path / "variant", norm_output=True)
    with pytest.raises(ValueError, match="'norm_output' is not supported"):
        LLM(str(path), **SMALL, speculative_method="eagle3", speculative_model=str(variant))
    with pytest.raises(ValueError, match="needs a model with multi-token-prediction layers"):
        LLM(str(path), **SMALL, speculative_method="mtp")


# -- DeepSeek-V3's multi-token-prediction layer -----------------------------------------


@pytest.fixture(scope="module")
def deepseek_mtp(tiny_checkpoint, tmp_path_factory):
    """The tiny DeepSeek-V3 with an MTP layer (`model.layers.3.*`, the checkpoint's
    layout), transformers' model, and a reference of the MTP layer built from
    transformers' decoder layer."""
    import shutil

    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RotaryEmbedding,
    )

    src = tiny_checkpoint("deepseek_v3")
    path = tmp_path_factory.mktemp("mtp")
    shutil.copytree(src, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))
    hf_config = AutoConfig.from_pretrained(path)
    hf_config._attn_implementation = "sdpa"  # causal without a mask
    torch.manual_seed(11)
    layer = DeepseekV3DecoderLayer(hf_config, layer_idx=3).eval()  # a MoE layer
    for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
        noise = torch.randn_like(tensor.data)
        tensor.data = 1 + 0.1 * noise if "layernorm" in name else 0.25 * noise
    own = {
        "enorm.weight": 1 + 0.1 * torch.randn(HIDDEN),
        "hnorm.weight": 1 + 0.1 * torch.randn(HIDDEN),
        "eh_proj.weight": 0.25 * torch.randn(HIDDEN, 2 * HIDDEN),
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(HIDDEN),
    }
    tensors = load_file(path / "model.safetensors")
    for name, tensor in [*layer.state_dict().items(), *own.items()]:
        tensors[f"model.layers.3.{name}"] = tensor.contiguous()
    save_file(tensors, path / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    rotary = DeepseekV3RotaryEmbedding(hf_config)

    def mtp_layer(embeds, hidden):
        positions = torch.arange(len(hidden))[None]
        embeds = torch.cat([torch.zeros_like(embeds[:1]), embeds[1:]])  # position 0: none
        x = torch.cat([rms(embeds, own["enorm.weight"]), rms(hidden, own["hnorm.weight"])], -1)
        x = (x @ own["eh_proj.weight"].T)[None]
        out = layer(x, position_ids=positions, position_embeddings=rotary(x, positions))
        return (out[0] if isinstance(out, tuple) else out)[0]

    def logits_of(out):
        return rms(out, own["shared_head.norm.weight"]) @ model.lm_head.weight.T

    def reference(tokens, k, sampling=None):
        with torch.no_grad():
            hidden = model.model(torch.tensor([tokens])).last_hidden_state[0]  # normed
            embed = model.model.embed_tokens.weight
            return reference_drafts(mtp_layer, logits_of, None, embed, tokens, hidden, k, sampling)

    return path, reference


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16}])
def test_mtp_drafts_are_the_layers_and_greedy_output_is_unchanged(deepseek_mtp, options):
    path, reference = deepseek_mtp
    prompts = _prompts()
    plain = LLM(str(path), **{**SMALL, **options}).generate(prompts, PARAMS)
    spec = dict(speculative_method="mtp", num_speculative_tokens=3, speculative_adaptive=False)
    llm = LLM(str(path), **{**SMALL, **options}, **spec)
    check(llm, plain, prompts, reference)


def test_the_catch_up_takes_the_kept_rows_after_any_gap_and_recomputed_rows_replace():
    from ember.engine.hidden_drafter import HiddenStateProposer
    from ember.engine.kv_cache import KVCacheManager
    from ember.engine.request import Request

    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    proposer = HiddenStateProposer(None, kv, [], torch.device("cpu"), 500)
    request = Request("r", list(range(100, 120)), SamplingParams(max_tokens=8), 8)
    kv.allocate_slots(request, 16)
    request.num_computed_tokens = 14  # the target's states from 14 on were of drafts

    def rows(first, last):  # a row's value: its position
        return torch.arange(first, last, dtype=torch.float32)[:, None]

    proposer.take_features(request, 0, rows(0, 6))
    proposer.take_features(request, 8, rows(8, 12))  # 6 and 7 never handed over
    proposer.take_features(request, 12, rows(12, 16))
    proposer.take_features(request, 10, rows(10, 17) + 0.5)  # computed again from 10
    assert proposer.lag(request) == 6  # the rows the catch-up reads
    entry = proposer._catch_up(request, 1)
    assert (entry.k, entry.rows.start) == (1, 8) and entry.rows.tokens == list(range(109, 115))
    assert entry.hidden[:, 0].tolist() == [8, 9, 10.5, 11.5, 12.5, 13.5]
    assert proposer._catch_up(request, 1) is None and proposer.lag(request) == 0  # all read
