"""`pagoda lora merge` against PEFT's own `merge_and_unload()` on tiny random models.

Llama and Qwen2 (plain LoRA on all projections, rsLoRA, modules_to_save, a sharded base, a tied
lm_head), Qwen2.5-VL (adapter saved with the new `model.language_model` / `model.visual` names
against a checkpoint with the old names, vision-tower and conv targets, non_lora_state_dict.bin),
dtype casting, the CLI, and the errors for adapters that do not fit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from pagoda.cli import main as cli_main  # noqa: E402
from pagoda.lora.merge import merge_lora  # noqa: E402
from tests.helpers import save_tiny_model  # noqa: E402
from tests.lora.adapters import make_adapter, randomize_adapter  # noqa: E402

TOKENS = torch.tensor([[5, 17, 42, 99, 7, 250, 3, 11, 64]])


def _hf(path: Path, cls_name: str = "AutoModelForCausalLM"):
    import transformers

    return getattr(transformers, cls_name).from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    return model(TOKENS).logits.float()


@pytest.mark.parametrize(
    "arch, lora_kwargs",
    [
        ("llama", dict()),
        ("qwen2", dict(use_rslora=True, modules_to_save=["lm_head"])),
        (
            "llama",
            dict(r=8, lora_alpha=4, rank_pattern={"down_proj": 2}, alpha_pattern={"o_proj": 32}),
        ),
    ],
    ids=["llama", "qwen2-rslora-lm_head", "llama-patterns"],
)
def test_merged_logits_equal_peft(arch: str, lora_kwargs: dict, tmp_path: Path) -> None:
    base = save_tiny_model(arch, tmp_path / "base")
    peft_model = make_adapter(base, tmp_path / "adapter", seed=1, **lora_kwargs)
    expected = _logits(peft_model.merge_and_unload())

    report = merge_lora(base, tmp_path / "adapter", tmp_path / "merged", progress=False)
    assert report.num_lora_modules == 7 * 2  # 7 projections x 2 layers
    assert report.num_replaced_tensors == (1 if "modules_to_save" in lora_kwargs else 0)
    torch.testing.assert_close(_logits(_hf(tmp_path / "merged")), expected, atol=1e-5, rtol=0)
    # the adapter really changes the model: the check above is not vacuous
    assert not torch.allclose(_logits(_hf(base)), expected, atol=1e-3)


def test_sharded_base_keeps_its_sharding(tmp_path: Path) -> None:
    small = save_tiny_model("llama", tmp_path / "small")
    _hf(small).save_pretrained(tmp_path / "base", max_shard_size="100KB")
    base = tmp_path / "base"
    index = json.loads((base / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    peft_model = make_adapter(base, tmp_path / "adapter", seed=2)
    expected = _logits(peft_model.merge_and_unload())

    merge_lora(base, tmp_path / "adapter", tmp_path / "merged", progress=False)
    merged = tmp_path / "merged"
    new_index = json.loads((merged / "model.safetensors.index.json").read_text())
    assert new_index["weight_map"] == index["weight_map"]
    assert sorted(p.name for p in merged.glob("*.safetensors")) == sorted(
        p.name for p in base.glob("*.safetensors")
    )
    assert (merged / "generation_config.json").is_file()
    torch.testing.assert_close(_logits(_hf(merged)), expected, atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
@pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`")
@pytest.mark.parametrize(
    "lora_kwargs",
    [
        dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
        dict(target_modules=["q_proj"], modules_to_save=["embed_tokens"]),
        dict(target_modules=["q_proj", "embed_tokens"]),
    ],
    ids=["head-trained", "embedding-trained", "embedding-lora"],
)
def test_tied_embeddings_are_untied_when_trained(lora_kwargs: dict, tmp_path: Path) -> None:
    base = save_tiny_model("qwen2", tmp_path / "base", tie_word_embeddings=True)
    peft_model = make_adapter(base, tmp_path / "adapter", seed=3, **lora_kwargs)
    # What the fine-tune computed: a trained head or embedding is PEFT's own copy, so the
    # other one keeps the original weights.
    expected = _logits(peft_model)

    report = merge_lora(base, tmp_path / "adapter", tmp_path / "merged", progress=False)
    assert report.untied_lm_head
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    torch.testing.assert_close(_logits(_hf(tmp_path / "merged")), expected, atol=1e-5, rtol=0)


def test_bf16_output(tmp_path: Path) -> None:
    from safetensors import safe_open

    base = save_tiny_model("llama", tmp_path / "base")
    peft_model = make_adapter(base, tmp_path / "adapter", seed=4)
    expected = peft_model.merge_and_unload().state_dict()

    merge_lora(base, tmp_path / "adapter", tmp_path / "merged", dtype="bf16", progress=False)
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "bfloat16" in (config.get("torch_dtype"), config.get("dtype"))
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            tensor = f.get_tensor(name)
            assert tensor.dtype == torch.bfloat16
            # merged in fp32, rounded once
            assert torch.equal(tensor, expected[name].to(torch.bfloat16))


def _tiny_qwen2_5_vl(path: Path) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=384,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            bos_token_id=1,
            eos_token_id=2,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
        ),
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path)
    return path


def test_qwen2_5_vl_vision_tower_and_non_lora_state_dict(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    base = _tiny_qwen2_5_vl(tmp_path / "base")
    model = _hf(base, "Qwen2_5_VLForConditionalGeneration")
    # In memory the names are new-style (model.language_model..., model.visual...); the saved
    # checkpoint keeps the old ones (model.layers..., visual...): matching must bridge both.
    assert any(n.startswith("model.visual.") for n, _ in model.named_parameters())
    target = r".*\.(q_proj|v_proj|qkv|down_proj|patch_embed\.proj)$"
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=target))
    randomize_adapter(peft_model, seed=5)
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    # A Qwen-VL fine-tuning repo also saves the trained merger (not LoRA) separately.
    gen = torch.Generator().manual_seed(6)
    merger = {
        "base_model.model.model.visual.merger.mlp.0.weight": torch.randn(128, 128, generator=gen),
        "base_model.model.model.visual.merger.mlp.0.bias": torch.randn(128, generator=gen),
    }
    torch.save(merger, adapter / "non_lora_state_dict.bin")
    expected = peft_model.merge_and_unload().state_dict()
    expected["model.visual.merger.mlp.0.weight"] = merger[
        "base_model.model.model.visual.merger.mlp.0.weight"
    ]
    expected["model.visual.merger.mlp.0.bias"] = merger[
        "base_model.model.model.visual.merger.mlp.0.bias"
    ]

    report = merge_lora(base, adapter, tmp_path / "merged", progress=False)
    assert report.num_replaced_tensors == 2
    # text q/v/down (2 layers x 3) + vision qkv/down (2 blocks x 2) + patch_embed conv
    assert report.num_lora_modules == 6 + 4 + 1
    merged = _hf(tmp_path / "merged", "Qwen2_5_VLForConditionalGeneration").state_dict()
    assert merged.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, atol=1e-6, rtol=0, msg=name)


def test_cli_merge(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = save_tiny_model("llama", tmp_path / "base")
    peft_model = make_adapter(base, tmp_path / "adapter", seed=7, target_modules=["q_proj"])
    rc = cli_main(
        [
            "lora",
            "merge",
            "--base",
            str(base),
            "--adapter",
            str(tmp_path / "adapter"),
            "--out",
            str(tmp_path / "merged"),
            "--no-progress",
        ]
    )
    assert rc == 0
    assert "merged 2 LoRA modules" in capsys.readouterr().out
    expected = _logits(peft_model.merge_and_unload())
    torch.testing.assert_close(_logits(_hf(tmp_path / "merged")), expected, atol=1e-5, rtol=0)

    # the output exists now: a second run refuses to overwrite it
    rc = cli_main(
        [
            "lora",
            "merge",
            "--base",
            str(base),
            "--adapter",
            str(tmp_path / "adapter"),
            "--out",
            str(tmp_path / "merged"),
            "--no-progress",
        ]
    )
    assert rc == 2
    assert "already exists" in capsys.readouterr().err


# ---------------------------------------------------------------------------- bad inputs


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("llama")
    base = save_tiny_model("llama", root / "base")
    make_adapter(base, root / "adapter", seed=8)
    return base, root / "adapter"


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial" in p.name)


def test_adapter_for_another_size_names_module_and_shapes(llama_adapter, tmp_path: Path) -> None:
    _, adapter = llama_adapter
    other = save_tiny_model("llama", tmp_path / "other", hidden_size=96)
    with pytest.raises(
        ValueError, match=r"adapter module '.*_proj'.*has shape.*96.*different base"
    ):
        merge_lora(other, adapter, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert _leftovers(tmp_path) == []


def test_adapter_module_missing_from_base(llama_adapter, tmp_path: Path) -> None:
    _, adapter = llama_adapter
    shallow = save_tiny_model("llama", tmp_path / "shallow", num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"layers\.1\..*does not have.*different base model"):
        merge_lora(shallow, adapter, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_files(llama_adapter, tmp_path: Path) -> None:
    base, adapter = llama_adapter
    with pytest.raises(FileNotFoundError, match="does not exist"):
        merge_lora(base, tmp_path / "nope", tmp_path / "out", progress=False)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        merge_lora(base, base, tmp_path / "out", progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors"):
        merge_lora(base, empty, tmp_path / "out", progress=False)
    with pytest.raises(FileNotFoundError, match="config.json"):
        merge_lora(adapter, adapter, tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="must differ"):
        merge_lora(base, adapter, base, progress=False)


def test_failed_write_leaves_nothing(llama_adapter, tmp_path: Path, monkeypatch) -> None:
    import safetensors.torch

    base, adapter = llama_adapter

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        merge_lora(base, adapter, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert _leftovers(tmp_path) == []


def test_dora_is_rejected(llama_adapter, tmp_path: Path) -> None:
    import shutil

    base, adapter = llama_adapter
    dora = tmp_path / "dora"
    shutil.copytree(adapter, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    config["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="DoRA"):
        merge_lora(base, dora, tmp_path / "out", progress=False)


def test_bin_adapter_with_adapter_names(llama_adapter, tmp_path: Path) -> None:
    """An adapter_model.bin whose keys still carry the `.default.` adapter name."""
    import shutil

    from safetensors.torch import load_file

    base, adapter = llama_adapter
    merge_lora(base, adapter, tmp_path / "from-st", progress=False)
    old = tmp_path / "old"
    shutil.copytree(adapter, old)
    state = load_file(str(old / "adapter_model.safetensors"))
    state = {k.replace(".weight", ".default.weight"): v for k, v in state.items()}
    torch.save(state, old / "adapter_model.bin")
    (old / "adapter_model.safetensors").unlink()
    merge_lora(base, old, tmp_path / "from-bin", progress=False)
    torch.testing.assert_close(
        _logits(_hf(tmp_path / "from-bin")), _logits(_hf(tmp_path / "from-st")), atol=0, rtol=0
    )


def test_quantized_base_is_refused_with_the_fix(llama_adapter, tmp_path: Path, capsys) -> None:
    from pagoda.quantizer.api import quantize

    base, adapter = llama_adapter
    with_tokenizer = tmp_path / "base"
    shutil.copytree(base, with_tokenizer)
    sym = Path(__file__).parents[1] / "fixtures" / "llmcompressor-tiny-w4a16" / "sym"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(sym / name, with_tokenizer / name)
    quantized = tmp_path / "w4a16"
    quantize(str(with_tokenizer), quantized, method="rtn", group_size=32, progress=False)
    argv = ["lora", "merge", "--base", str(quantized), "--adapter", str(adapter)]
    code = cli_main([*argv, "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (
        f"error: the base model {quantized} is quantized (quantization_config: "
        "compressed-tensors); merge the adapter into the unquantized (bf16) model it was "
        "trained on, then quantize the merged model\n"
    )
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []
