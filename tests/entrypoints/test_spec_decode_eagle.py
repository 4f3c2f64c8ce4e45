"""Speculative decoding with an EAGLE head, through the whole engine, on tiny random models.

The head loads from an EAGLE-1 layout directory (fc.weight, layers.0.*; the target's embedding
shared), computes the EAGLE formula (checked against a plain-torch reference), and in the
engine proposes exactly what that reference proposes from the accepted tokens: the head
follows every step with the target's features, one position behind. Greedy output equals
plain decoding's under prefix caching, chunked prefill and preemption, no block leaks, and a
head that does not fit its target is one ValueError naming the problem.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pagoda import LLM, SamplingParams
from pagoda.config import ModelConfig
from pagoda.model_files import ModelSource, load_hf_config
from pagoda.models.eagle import load_eagle_head
from tests.entrypoints.test_spec_decode import _llm
from tests.helpers import save_tiny_model, tiny_config

VOCAB = 384


def save_head(path, arch="llama", seed=0, fc_bias=False, std=0.15, **overrides):
    """A random EAGLE-1 layout head: config.json + fc.weight (+ fc.bias) + layers.0.* (HF
    names, no layers.0.input_layernorm) + the target-sized embed_tokens EAGLE-1 ships."""
    cfg = tiny_config(arch, **{"vocab_size": VOCAB, "num_hidden_layers": 1, **overrides})
    path.mkdir(parents=True, exist_ok=True)
    cfg.to_json_file(path / "config.json")
    g = torch.Generator().manual_seed(seed)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    d = h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * std

    t = {
        "fc.weight": rnd(h, 2 * h),
        "embed_tokens.weight": rnd(VOCAB, h),
        "layers.0.self_attn.q_proj.weight": rnd(q, h),
        "layers.0.self_attn.k_proj.weight": rnd(kv, h),
        "layers.0.self_attn.v_proj.weight": rnd(kv, h),
        "layers.0.self_attn.o_proj.weight": rnd(h, q),
        "layers.0.mlp.gate_proj.weight": rnd(inter, h),
        "layers.0.mlp.up_proj.weight": rnd(inter, h),
        "layers.0.mlp.down_proj.weight": rnd(h, inter),
        "layers.0.post_attention_layernorm.weight": 1 + rnd(h),
    }
    if fc_bias:
        t["fc.bias"] = rnd(h)
    if arch == "qwen2":
        t |= {
            f"layers.0.self_attn.{n}_proj.bias": rnd(s) for n, s in (("q", q), ("k", kv), ("v", kv))
        }
    save_file(t, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    return {
        "target": save_tiny_model("llama", root / "target", vocab_size=VOCAB),
        "head": save_head(root / "head"),
        "head_bias": save_head(root / "head_bias", seed=1, fc_bias=True),
    }


def _load(path, dtype="float32"):
    hf = load_hf_config(ModelSource("hf_dir", str(path), path.name))
    mc = ModelConfig(model=str(path), hf_config=hf, dtype=dtype, max_model_len=256)
    return load_eagle_head(mc, torch.device("cpu"), None)


def _rope(x, pos, theta):  # [T, n, d], neox-style (HF Llama)
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference_head(path, embeds, feats, pos):
    """The EAGLE formula in plain torch from the stored tensors: causal over one sequence."""
    cfg = json.loads((path / "config.json").read_text())
    w = load_file(str(path / "model.safetensors"))
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // nh
    theta = cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    t = embeds.shape[0]
    p = "layers.0."

    def lin(x, name):
        return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))

    x = lin(torch.cat((embeds, feats), -1), "fc")
    q = _rope(lin(x, p + "self_attn.q_proj").view(t, nh, d), pos, theta)
    k = _rope(lin(x, p + "self_attn.k_proj").view(t, nkv, d), pos, theta)
    v = lin(x, p + "self_attn.v_proj").view(t, nkv, d)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    a = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, nh * d)
    r = x + lin(a, p + "self_attn.o_proj")
    n = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"])
    n = n * w[p + "post_attention_layernorm.weight"]
    return r + lin(
        F.silu(lin(n, p + "mlp.gate_proj")) * lin(n, p + "mlp.up_proj"), p + "mlp.down_proj"
    )


@pytest.mark.parametrize("name", ["head", "head_bias"])
def test_head_forward_matches_the_eagle_formula(models, name):
    head = _load(models[name])
    assert (head.fc.bias is not None) == (name == "head_bias")
    assert isinstance(head.layers[0].input_layernorm, torch.nn.Identity)
    g = torch.Generator().manual_seed(0)
    embeds, feats = torch.randn(11, 64, generator=g), torch.randn(11, 64, generator=g)
    pos = torch.arange(5, 16)
    with torch.no_grad():
        got = head(embeds, feats, pos, None)
    want = reference_head(models[name], embeds, feats, pos)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_qwen2_head_with_an_input_norm(tmp_path):
    """q/k/v bias from a Qwen2 config; a stored layers.0.input_layernorm is applied."""
    path = save_head(tmp_path / "h", arch="qwen2")
    t = load_file(str(path / "model.safetensors"))
    save_file(
        {**t, "layers.0.input_layernorm.weight": torch.ones(64)}, str(path / "model.safetensors")
    )
    head = _load(path)
    assert head.layers[0].self_attn.qkv_proj.bias is not None
    assert not isinstance(head.layers[0].input_layernorm, torch.nn.Identity)


def test_head_layer_options_are_the_target_familys():
    """The head's decoder layer takes the options its family's model class defines (Qwen3 with
    attention_bias: q/k norm and biases), whatever name its architectures field carries."""
    from types import SimpleNamespace

    from pagoda.models.eagle import head_decoder_options
    from pagoda.models.qwen3 import Qwen3ForCausalLM

    cfg = SimpleNamespace(model_type="qwen3", attention_bias=True, architectures=["EagleHead"])
    opts = head_decoder_options(cfg, sliding_window=None)
    assert opts == Qwen3ForCausalLM.decoder_options(cfg)
    assert opts.qk_norm and opts.qkv_bias and opts.o_proj_bias
    windowed = head_decoder_options(SimpleNamespace(model_type="mistral", sliding_window=4), 9)
    assert windowed.sliding_window == 9  # the target's window, not the head config's


def _engine_error(models, head_dir) -> str:
    with pytest.raises(ValueError) as e:
        _llm(models["target"], speculative_config=_spec(head_dir))
    return str(e.value)


def test_head_of_another_hidden_size_is_one_clear_error(models, tmp_path):
    msg = _engine_error(
        models, save_head(tmp_path / "wide", hidden_size=128, intermediate_size=256)
    )
    assert "hidden_size 128 (head) != 64 (target)" in msg and "EAGLE head" in msg


def test_unknown_and_misshapen_tensors_are_one_clear_error(models, tmp_path):
    path = save_head(tmp_path / "bad")
    t = load_file(str(path / "model.safetensors"))
    t["layers.0.mlp.extra.weight"] = torch.zeros(3)
    t["layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)
    del t["layers.0.self_attn.o_proj.weight"]
    save_file(t, str(path / "model.safetensors"))
    msg = _engine_error(models, path)
    assert "unknown tensors layers.0.mlp.extra.weight" in msg
    assert "layers.0.mlp.up_proj.weight (100, 64) (expected (128, 64))" in msg
    assert "missing tensors layers.0.self_attn.o_proj.weight" in msg


def test_other_vocabulary_and_no_head_are_clear_errors(models, tmp_path):
    msg = _engine_error(models, save_head(tmp_path / "v", vocab_size=500))
    assert "vocab_size 500 (head) != 384 (target)" in msg
    with pytest.raises(ValueError, match="needs the head's 'model'"):
        _llm(models["target"], speculative_config={"method": "eagle", "num_speculative_tokens": 2})


def _spec(head, k=3, **kw) -> dict:
    return {
        "method": "eagle",
        "model": str(head),
        "num_speculative_tokens": k,
        "adaptive": False,
        **kw,
    }


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (9, 23, 40, 5)]


VARIANTS = {
    "default": {},
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(num_gpu_blocks_override=9, max_model_len=128),
}


def _record_proposals(llm) -> list[tuple[str, int, list[int]]]:
    """(req_id, position of the newest token, drafts) of every proposal the runner makes."""
    runner = llm.llm_engine.core.runner
    log = []
    original = runner.propose_drafts

    def wrapped(reqs):
        out = original(reqs)
        log.extend((r.req_id, r.position, out[r.req_id]) for r in reqs)
        return out

    runner.propose_drafts = wrapped
    return log


def _reference_drafts(models, llm, tokens, position, n):
    """The drafts the EAGLE formula gives after tokens[: position + 1], computed from scratch:
    the target's features over the accepted tokens, the head over (f_i, token_{i+1}), then
    the head chained on its own output."""
    target = llm.llm_engine.core.runner.model
    embed, logits = target.model.embed_tokens, target.compute_logits
    known = torch.tensor(tokens[: position + 1])
    with torch.no_grad():
        feats = target(known[:-1], torch.arange(position), None)  # f_0 .. f_{position-1}
        embeds, pos, drafts = embed(known[1:]), torch.arange(position), []
        for _ in range(n):
            out = reference_head(models["head"], embeds, feats, pos)
            drafts.append(int(logits(out[-1:]).argmax()))
            feats = torch.cat((feats, out[-1:]))
            embeds = torch.cat((embeds, embed(torch.tensor(drafts[-1:]))))
            pos = torch.arange(len(pos) + 1)
    return drafts


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_equals_plain_and_proposals_follow_the_formula(models, variant):
    prompts = _prompts()
    max_tokens = [24, 24, 11, 13]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    plain = _llm(models["target"], **VARIANTS[variant]).generate(prompts, params, use_tqdm=False)
    llm = _llm(models["target"], speculative_config=_spec(models["head"]), **VARIANTS[variant])
    log = _record_proposals(llm)
    spec = llm.generate(prompts, params, use_tqdm=False)
    for a, b, n in zip(plain, spec, max_tokens, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.outputs[0].token_ids) == n
    assert sum(o.metrics.spec_num_draft_tokens for o in spec) > 0
    # every proposal (of a sample, to keep the test fast) is the formula's on the accepted tokens
    full = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in spec}
    checked = 0
    for req_id, position, drafts in log[:: max(1, len(log) // 12)]:
        want = _reference_drafts(models, llm, full[req_id], position, len(drafts))
        assert drafts == want, (req_id, position)
        checked += 1
    assert checked >= 8
    core = llm.llm_engine.core
    assert core.kv_cache_manager.num_free_blocks == core.memory_report.num_blocks


def test_sampling_and_many_requests_release_every_block(models):
    """Mixed temperatures, lengths and max_tokens through a small pool (preemption and the
    head's lookahead slots): every block comes back, seeded sampling is reproducible."""
    llm = _llm(
        models["target"],
        speculative_config=_spec(models["head_bias"], k=2),
        num_gpu_blocks_override=24,
        max_model_len=128,
    )
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 30))] for _ in range(24)]
    params = [
        SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randrange(1, 20), seed=i)
        for i in range(24)
    ]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert first == again
    core = llm.llm_engine.core
    assert core.kv_cache_manager.num_free_blocks == core.memory_report.num_blocks


def test_cli_json_reaches_the_engine(models):
    from pagoda.config import SpeculativeConfig

    cfg = SpeculativeConfig.from_user(json.dumps(_spec(models["head"], k=4)))
    assert cfg.method == "eagle" and cfg.model == str(models["head"])
    llm = LLM(
        str(models["target"]),
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        print_memory_report=False,
        max_model_len=128,
        speculative_config=json.dumps(_spec(models["head"], k=4)),
    )
    assert type(llm.llm_engine.core.runner.draft).__name__ == "EagleDraft"
