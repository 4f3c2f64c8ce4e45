"""Llama / Qwen2 / Qwen3 / Mistral against Hugging Face transformers on the same random weights.

Each tiny config is built here, an HF model is created under a fixed seed and saved as
safetensors, and pagoda's loader reads it back. Logits must match HF's (a) for a full prompt
without a KV cache and (b) through the paged cache: a batched, chunked prefill of two sequences
with 4-token blocks followed by one-token decode steps (teacher-forced), padding rows included.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from pagoda.config import ModelConfig
from pagoda.layers.attention import AttentionMetadata, _triton_kernels
from pagoda.models.llama import LlamaForCausalLM
from pagoda.models.loader import iter_safetensors_weights, load_model
from pagoda.models.mistral import MistralForCausalLM
from pagoda.models.qwen2 import Qwen2ForCausalLM
from pagoda.models.qwen3 import Qwen3ForCausalLM
from pagoda.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

VOCAB = 256
BLOCK_SIZE = 4
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def _config(name: str) -> PretrainedConfig:
    if name == "llama":
        return LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])
    if name == "llama_tied":
        return LlamaConfig(**TINY, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    if name == "llama3_rope":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 500000.0,
        }
        return LlamaConfig(**TINY, rope_parameters=rope, architectures=["LlamaForCausalLM"])
    if name == "qwen2":
        return Qwen2Config(**TINY, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
    if name == "qwen3":
        # head_dim 32 != hidden / heads (16): Qwen3 takes it from the config.
        return Qwen3Config(**TINY, head_dim=32, architectures=["Qwen3ForCausalLM"])
    if name == "mistral":
        # A window of 6 over 4-token blocks: shorter than every test sequence, not a multiple
        # of the block size, so prefill chunks and decodes all cut keys off.
        return MistralConfig(**TINY, sliding_window=6, architectures=["MistralForCausalLM"])
    if name == "mistral_no_window":
        return MistralConfig(**TINY, sliding_window=None, architectures=["MistralForCausalLM"])
    raise AssertionError(name)


CONFIGS = ["llama", "llama_tied", "llama3_rope", "qwen2", "qwen3", "mistral", "mistral_no_window"]


def _make_hf_model(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """HF model with weights large enough that attention patterns and biases matter."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.2 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module", params=CONFIGS)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(HF model, pagoda model) on the same weights, loaded through safetensors."""
    config = _config(request.param)
    hf_model = _make_hf_model(config)
    model_dir = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(model_dir)
    model_config = ModelConfig(
        model=str(model_dir), hf_config=config, dtype="float32", max_model_len=128
    )
    return hf_model, load_model(model_config, torch.device("cpu"))


def _hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    device = next(hf_model.parameters()).device
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids], device=device)).logits[0].float()  # [L, V]


def test_full_prompt_forward_matches_hf(pair) -> None:
    hf_model, model = pair
    token_ids = torch.randint(0, VOCAB, (19,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model(token_ids, torch.arange(len(token_ids)), None)
        logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (len(token_ids), VOCAB)
    torch.testing.assert_close(
        logits, _hf_logits(hf_model, token_ids.tolist()), atol=1e-4, rtol=1e-4
    )


class PagedRunner:
    """A minimal model runner: block tables, slot mapping and metadata for each step."""

    def __init__(self, model: torch.nn.Module, num_blocks: int = 24) -> None:
        self.model = model
        param = next(model.parameters())
        self.device = param.device
        attn = model.attention_layers()
        self.caches = [
            torch.zeros(
                2,
                num_blocks,
                BLOCK_SIZE,
                a.num_kv_heads,
                a.head_dim,
                dtype=param.dtype,
                device=self.device,
            )  # fmt: skip
            for a in attn
        ]
        for layer, cache in zip(attn, self.caches, strict=True):
            layer.kv_cache = cache
        # Hand out blocks from the top, in reverse, so tables are not contiguous; 0 is the null
        # block and is never used.
        self.free = list(range(1, num_blocks))
        self.block_ids: dict[str, list[int]] = {}

    def step(
        self, work: list[tuple[str, list[int], int, int]], num_padding: int = 0
    ) -> dict[str, torch.Tensor]:
        """work: (seq id, all token ids, num computed, num new). Returns logits per seq [new, V]."""
        input_ids, positions, slots = [], [], []
        query_start_loc, seq_lens, tables = [0], [], []
        for seq_id, token_ids, num_computed, num_new in work:
            seq_len = num_computed + num_new
            blocks = self.block_ids.setdefault(seq_id, [])
            while len(blocks) < math.ceil(seq_len / BLOCK_SIZE):
                blocks.append(self.free.pop())
            for pos in range(num_computed, seq_len):
                input_ids.append(token_ids[pos])
                positions.append(pos)
                slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(seq_len)
            tables.append(blocks)
        num_tokens = len(input_ids)
        # Padding tokens (as CUDA graphs add): arbitrary ids, slot -1.
        input_ids += [0] * num_padding
        positions += [0] * num_padding
        slots += [-1] * num_padding
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.zeros(len(work), max_blocks, dtype=torch.int32)
        for b, table in enumerate(tables):
            block_tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
        dev = self.device
        metadata = AttentionMetadata(
            num_actual_tokens=num_tokens,
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(w[3] for w in work),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        with torch.no_grad():
            hidden = self.model(
                torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev), metadata
            )
            logits = self.model.compute_logits(hidden[:num_tokens])
        return {
            w[0]: logits[query_start_loc[b] : query_start_loc[b + 1]] for b, w in enumerate(work)
        }


def test_paged_prefill_and_decode_match_hf(pair) -> None:
    _check_paged_against_hf(*pair, atol=1e-4, rtol=1e-4)


def _check_paged_against_hf(hf_model, model, atol: float, rtol: float) -> None:
    gen = torch.Generator().manual_seed(2)
    seqs = {
        "a": torch.randint(0, VOCAB, (13,), generator=gen).tolist(),  # prompt 7 + 6 decodes
        "b": torch.randint(0, VOCAB, (16,), generator=gen).tolist(),  # prompt 10 + 6 decodes
    }
    expected = {s: _hf_logits(hf_model, ids) for s, ids in seqs.items()}
    runner = PagedRunner(model)
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": []}

    def record(out: dict[str, torch.Tensor]) -> None:
        for s, logits in out.items():
            got[s].append(logits)

    # Step 1: all of a's prompt and the first chunk of b's, in one batch, with padding.
    record(runner.step([("a", seqs["a"], 0, 7), ("b", seqs["b"], 0, 6)], num_padding=3))
    # Step 2: a decodes while b finishes its prompt (mixed batch, b's chunk crosses blocks).
    record(runner.step([("a", seqs["a"], 7, 1), ("b", seqs["b"], 6, 4)]))
    # Decode steps, one token each (teacher-forced with the fixed sequences).
    for i in range(5):
        record(runner.step([("a", seqs["a"], 8 + i, 1), ("b", seqs["b"], 10 + i, 1)], 1))
    for s in seqs:
        logits = torch.cat(got[s]).cpu()  # [L - 1, V]: the last token is never fed
        torch.testing.assert_close(logits, expected[s][: len(logits)].cpu(), atol=atol, rtol=rtol)
        assert len(logits) == len(seqs[s]) - 1 + (s == "a")


def test_attention_layers_in_order(pair) -> None:
    _, model = pair
    layers = model.attention_layers()
    assert layers == [layer.self_attn.attn for layer in model.model.layers]
    assert len(layers) == TINY["num_hidden_layers"]


def test_tied_embeddings_share_storage(pair) -> None:
    _, model = pair
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == model.tie_word_embeddings


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    config = _config("qwen2")
    hf_model = _make_hf_model(config)
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model_config = ModelConfig(
        model=str(tmp_path), hf_config=config, dtype="float32", max_model_len=64
    )
    model = load_model(model_config, "cpu")
    ids = torch.arange(9)
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(9), None))
    torch.testing.assert_close(logits, _hf_logits(hf_model, ids.tolist()), atol=1e-4, rtol=1e-4)


def test_bfloat16_build(tmp_path: Path) -> None:
    config = _config("qwen3")
    _make_hf_model(config).save_pretrained(tmp_path)
    model_config = ModelConfig(
        model=str(tmp_path), hf_config=config, dtype="bfloat16", max_model_len=64
    )
    model = load_model(model_config, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_cache.dtype == torch.float32
    with torch.no_grad():
        logits = model.compute_logits(model(torch.arange(5), torch.arange(5), None))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_missing_weight_is_named(tmp_path: Path) -> None:
    config = _config("llama")
    weights = [
        (n, t)
        for n, t in _make_hf_model(config).state_dict().items()
        if n != "model.layers.1.self_attn.k_proj.weight"
    ]
    model = LlamaForCausalLM(config)
    with pytest.raises(
        ValueError, match=r"missing .*model\.layers\.1\.self_attn\.qkv_proj\.weight"
    ):
        model.load_weights(weights)


def test_unexpected_weight_is_named() -> None:
    config = _config("llama")
    weights = list(_make_hf_model(config).state_dict().items())
    weights.append(("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8)))  # skipped
    weights.append(("model.layers.0.mlp.extra.weight", torch.zeros(3)))
    with pytest.raises(ValueError, match=r"mlp\.extra\.weight"):
        LlamaForCausalLM(config).load_weights(weights)


def test_corrupt_or_missing_files_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(ValueError, match="model.safetensors"):
        list(iter_safetensors_weights(tmp_path))
    bad.unlink()
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(ValueError, match="model-00001-of-00002.safetensors"):
        list(iter_safetensors_weights(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        list(iter_safetensors_weights(tmp_path / "nothing_here"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        list(iter_safetensors_weights(tmp_path / "empty"))


def test_dummy_weights_are_deterministic_and_well_conditioned() -> None:
    config = _config("llama_tied")

    def logits_for(seed: int) -> torch.Tensor:
        model_config = ModelConfig(
            model="dummy", hf_config=config, dtype="float32", max_model_len=64,
            load_format="dummy", seed=seed,
        )  # fmt: skip
        model = load_model(model_config, "cpu")
        assert not model.training
        with torch.no_grad():
            return model.compute_logits(model(torch.arange(6), torch.arange(6), None))

    first, again, other = logits_for(0), logits_for(0), logits_for(1)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert torch.isfinite(first).all() and 0.05 < first.std() < 10


def test_unsupported_quantization_config_is_refused() -> None:
    # Quantized checkpoints load through WNA16LinearMethod (tests/quant); others are refused.
    config = _config("llama")
    model_config = ModelConfig(
        model="x", hf_config=config, dtype="float32", max_model_len=64,
        quantization={"quant_method": "bitsandbytes"},
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="compressed-tensors"):
        load_model(model_config, "cpu")


def test_registry() -> None:
    assert get_model_class(["LlamaForCausalLM"]) is LlamaForCausalLM
    assert get_model_class(["Qwen2ForCausalLM"]) is Qwen2ForCausalLM
    assert get_model_class(["Qwen3ForCausalLM"]) is Qwen3ForCausalLM
    assert get_model_class(["MistralForCausalLM"]) is MistralForCausalLM
    with pytest.raises(ValueError) as excinfo:
        get_model_class(["Foo"])
    message = str(excinfo.value)
    assert "Foo" in message and all(arch in message for arch in SUPPORTED_ARCHITECTURES)


def test_linear_method_factory_sees_every_projection_but_lm_head() -> None:
    from pagoda.layers.linear import UnquantizedLinearMethod

    prefixes: list[str] = []

    def factory(prefix: str) -> UnquantizedLinearMethod:
        prefixes.append(prefix)
        return UnquantizedLinearMethod()

    Qwen3ForCausalLM(_config("qwen3"), factory)
    assert prefixes[:4] == [
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.0.mlp.down_proj",
    ]
    assert len(prefixes) == 4 * TINY["num_hidden_layers"]
    assert not any("lm_head" in p for p in prefixes)


def test_mistral_window_reaches_every_layer() -> None:
    """The window is not dropped on the way (as mapping Mistral onto Llama would do)."""
    model = MistralForCausalLM(_config("mistral"))
    assert [a.sliding_window for a in model.attention_layers()] == [6, 6]
    none = MistralForCausalLM(_config("mistral_no_window"))
    assert [a.sliding_window for a in none.attention_layers()] == [None, None]
    config = _config("mistral")
    config.sliding_window = 0
    with pytest.raises(ValueError, match="config.sliding_window must be null or an int >= 1"):
        MistralForCausalLM(config)


def test_mistral_window_changes_the_logits(pair) -> None:
    """Sanity of the oracle: on 19 tokens a window of 6 gives other logits than full attention
    (so the equality tests above could fail if the window were ignored)."""
    hf_model, model = pair
    if getattr(model, "config", None) is None or model.config.model_type != "mistral":
        pytest.skip("Mistral only")
    token_ids = torch.randint(0, VOCAB, (19,), generator=torch.Generator().manual_seed(1))
    window = model.config.sliding_window
    full = _hf_logits(hf_model, token_ids.tolist())
    hf_model.config.sliding_window = None if window else 6
    try:
        other = _hf_logits(hf_model, token_ids.tolist())
    finally:
        hf_model.config.sliding_window = window
    assert not torch.allclose(full[8:], other[8:], atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_on_cuda_matches_hf(name: str, dtype: str, tmp_path: Path) -> None:
    """The Triton path (cache write + paged attention) inside the model, against HF on CUDA."""
    config = _config(name)
    _make_hf_model(config).save_pretrained(tmp_path)
    # The oracle is HF in float32: bf16 rounding alone moves these O(5) logits by ~0.2.
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()
    model_config = ModelConfig(
        model=str(tmp_path), hf_config=config, dtype=dtype, max_model_len=128
    )
    model = load_model(model_config, torch.device("cuda"))
    assert _triton_kernels() is not None, "Triton kernels failed to import; refs would run"
    if dtype == "float32":
        _check_paged_against_hf(hf_model, model, atol=1e-3, rtol=1e-3)
    else:
        _check_paged_against_hf(hf_model, model, atol=0.5, rtol=0.02)
