"""`merge_lora`: fold a PEFT LoRA adapter into its base model and write a normal HF directory.

The base checkpoint is read one safetensors shard at a time and written with the same sharding,
so memory stays around one shard plus the adapter. Every adapter tensor is matched to a base
tensor (old and new HF layouts alike) and checked before anything is written; the output is
built in a hidden temporary directory and renamed at the end, so a failed run leaves nothing.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagoda.config import normalize_dtype
from pagoda.lora.adapter import LoRAModule, PeftAdapter, canonical_name, load_adapter

logger = logging.getLogger("pagoda")

_INDEX_FILE = "model.safetensors.index.json"
_LM_HEAD = "lm_head.weight"
_EMBED = "model.embed_tokens.weight"  # canonical name
# Weight files of the base that are rewritten (safetensors) or must not be carried over stale.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
_WEIGHT_INDEXES = (_INDEX_FILE, "pytorch_model.bin.index.json")
# Tokenizer / processor files a fine-tune may have changed (a new chat template, say); when the
# adapter directory has them, they win over the base's.
_ADAPTER_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)


@dataclass
class MergeReport:
    """What `merge_lora` did, for the CLI to print."""

    out_dir: Path
    num_lora_modules: int
    num_replaced_tensors: int
    num_shards: int
    untied_lm_head: bool = False
    files_from_adapter: list[str] = field(default_factory=list)


@dataclass
class _Plan:
    """Per base tensor name: the changes to apply, decided before any shard is read."""

    deltas: dict[str, LoRAModule] = field(default_factory=dict)
    bias_deltas: dict[str, torch.Tensor] = field(default_factory=dict)  # already scaled
    replacements: dict[str, torch.Tensor] = field(default_factory=dict)
    untie: bool = False  # the trained model no longer shares embedding and head
    untie_from: str | None = None  # the embedding a head without a tensor is materialised from


# Tensor names of packed quantized weights (compressed-tensors, GPTQ/AWQ).
_PACKED_SUFFIXES = (".weight_packed", ".qweight", ".qzeros")


def merge_lora(
    base_dir: str | os.PathLike[str],
    adapter_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: Any = None,
    progress: bool = True,
) -> MergeReport:
    """Write `base + adapter` to `out_dir`. `dtype` ("bf16", torch.float16, ...) casts floats.

    Raises FileNotFoundError for missing inputs and ValueError when the adapter does not fit
    the base (a module it names is absent, or shapes differ) or `out_dir` is not empty.
    """
    base = Path(base_dir).expanduser()
    out = Path(out_dir).expanduser()
    out_dtype = _out_dtype(dtype)
    _check_dirs(base, Path(adapter_dir).expanduser(), out)
    shards, index = _base_shards(base)
    headers = _read_headers(base, shards)
    _check_not_quantized(base, headers)
    adapter = load_adapter(adapter_dir)
    plan = _make_plan(adapter, headers, base, _tied_embeddings(base, headers))

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        written = _write_shards(base, shards, headers, plan, out_dtype, tmp, progress)
        if index is not None:
            new_index = {
                "metadata": {
                    **(index.get("metadata") or {}),
                    "total_size": sum(nbytes for _, nbytes in written.values()),
                },
                "weight_map": {name: shard for name, (shard, _) in sorted(written.items())},
            }
            (tmp / _INDEX_FILE).write_text(json.dumps(new_index, indent=2) + "\n")
        from_adapter = _copy_side_files(base, adapter.path, tmp)
        _update_config(tmp / "config.json", out_dtype, untie=plan.untie)
        if out.exists():
            out.rmdir()  # checked empty above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return MergeReport(
        out_dir=out,
        num_lora_modules=len(adapter.modules),
        num_replaced_tensors=len(plan.replacements),
        num_shards=len(shards),
        untied_lm_head=plan.untie,
        files_from_adapter=from_adapter,
    )


# ---------------------------------------------------------------------------- inputs


def _out_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None:
        return None
    name = normalize_dtype(dtype)
    return None if name == "auto" else getattr(torch, name)


def _check_dirs(base: Path, adapter: Path, out: Path) -> None:
    if not base.is_dir():
        raise FileNotFoundError(f"base model directory {str(base)!r} does not exist")
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"{base}: no config.json; not a Hugging Face model directory")
    if not adapter.is_dir():
        raise FileNotFoundError(f"adapter directory {str(adapter)!r} does not exist")
    resolved = out.resolve()
    if resolved in (base.resolve(), adapter.resolve()):
        raise ValueError(f"--out {str(out)!r} must differ from the base and adapter directories")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output {str(out)!r} already exists and is not empty; remove it first")


def _base_shards(base: Path) -> tuple[list[str], dict | None]:
    """Shard file names in order, and the index json when the checkpoint is sharded."""
    index_path = base / _INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index_path}: not a valid safetensors index ({e})") from None
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not (base / shard).is_file():
                raise FileNotFoundError(f"{base / shard}: listed in {_INDEX_FILE} but missing")
        return shards, index
    shards = sorted(p.name for p in base.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(
            f"{base}: no *.safetensors files (convert a pytorch_model.bin checkpoint with "
            "transformers' save_pretrained first)"
        )
    return shards, None


def _read_headers(base: Path, shards: list[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (shard, shape) from the safetensors headers alone (no tensor data read)."""
    from safetensors import SafetensorError, safe_open

    headers: dict[str, tuple[str, tuple[int, ...]]] = {}
    for shard in shards:
        try:
            with safe_open(str(base / shard), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    headers[name] = (shard, tuple(f.get_slice(name).get_shape()))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{base / shard}: cannot read safetensors file ({e})") from None
    return headers


def _check_not_quantized(base: Path, headers: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """A LoRA delta adds to dense weights; a quantized base has packed integer codes instead."""
    try:
        config = json.loads((base / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{base / 'config.json'} is not valid JSON: {e}") from None
    qc = next(
        (
            sec["quantization_config"]
            for sec in (config, config.get("text_config"))
            if isinstance(sec, dict) and sec.get("quantization_config")
        ),
        None,
    )
    packed = next((n for n in headers if n.endswith(_PACKED_SUFFIXES)), None)
    if qc is None and packed is None:
        return
    what = (
        f"quantization_config: {qc.get('quant_method', 'quantized')}"
        if isinstance(qc, dict)
        else f"packed tensor {packed}"
    )
    raise ValueError(
        f"the base model {base} is quantized ({what}); merge the adapter into the unquantized "
        "(bf16) model it was trained on, then quantize the merged model"
    )


# ---------------------------------------------------------------------------- matching


def _tied_embeddings(base: Path, headers: dict[str, tuple[str, tuple[int, ...]]]) -> bool:
    """Whether the base model shares its input embedding with the LM head."""
    try:
        config = json.loads((base / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{base / 'config.json'} is not valid JSON: {e}") from None
    for section in (config.get("text_config"), config):
        if isinstance(section, dict) and "tie_word_embeddings" in section:
            return bool(section["tie_word_embeddings"])
    return not any(canonical_name(name) == _LM_HEAD for name in headers)


def _make_plan(
    adapter: PeftAdapter,
    headers: dict[str, tuple[str, tuple[int, ...]]],
    base: Path,
    tied: bool,
) -> _Plan:
    """Match every adapter tensor to a base tensor and check shapes; raise on any misfit."""
    by_canonical: dict[str, str] = {}
    for name in headers:
        by_canonical.setdefault(canonical_name(name), name)
    embed = by_canonical.get(_EMBED)
    # A tied head may have no tensor of its own; training it gives it one.
    head_from_embed = tied and embed is not None and _LM_HEAD not in by_canonical
    plan = _Plan()
    hint = adapter.describe_base()

    def resolve(name: str, what: str) -> str:
        canon = canonical_name(name)
        found = by_canonical.get(canon)
        if found is not None:
            return found
        if canon == _LM_HEAD and head_from_embed:
            plan.untie_from = embed
            return _LM_HEAD
        close = difflib.get_close_matches(canon, list(by_canonical), n=1)
        suggestion = f" (closest base tensor: {close[0]!r})" if close else ""
        raise ValueError(
            f"{what} needs base tensor {name!r}, which the base model at {base} does not have"
            f"{suggestion}{hint}; the adapter was probably trained for a different base model"
        )

    def base_shape(name: str) -> tuple[int, ...]:
        if name == _LM_HEAD and plan.untie_from is not None and name not in headers:
            return headers[plan.untie_from][1]
        return headers[name][1]

    for module in adapter.modules.values():
        target = resolve(f"{module.name}.weight", f"adapter module {module.name!r}")
        expected = module.delta_shape()
        if base_shape(target) != expected:
            raise ValueError(
                f"adapter module {module.name!r}: B @ A has shape {expected} (lora_A "
                f"{tuple(module.lora_a.shape)}, lora_B {tuple(module.lora_b.shape)}) but base "
                f"tensor {target!r} has shape {base_shape(target)}{hint}; the adapter was "
                "trained for a different base model (or another size of it)"
            )
        plan.deltas[target] = module
        if module.lora_b_bias is not None:
            bias = resolve(f"{module.name}.bias", f"lora_bias of {module.name!r}")
            plan.bias_deltas[bias] = module.lora_b_bias.float() * module.scale

    for name, tensor in adapter.full_tensors.items():
        target = resolve(name, f"trained tensor {name!r}")
        if base_shape(target) != tuple(tensor.shape):
            raise ValueError(
                f"trained tensor {name!r} has shape {tuple(tensor.shape)} but base tensor "
                f"{target!r} has shape {base_shape(target)}{hint}; a different base model, or "
                "a resized vocabulary (not supported: resize the base model first)"
            )
        plan.replacements[target] = tensor

    # While training, PEFT gives a trained embedding or head its own copy (unless
    # ensure_weight_tying): the fine-tuned model has an untied head, the original embedding's
    # unless the head itself was trained.
    changed = plan.deltas.keys() | plan.replacements.keys()
    head = by_canonical.get(_LM_HEAD, _LM_HEAD)
    keep_tied = adapter.config.ensure_weight_tying
    if tied and (head in changed or (embed in changed and not keep_tied)):
        plan.untie = True
        if head_from_embed:
            plan.untie_from = embed
    return plan


# ---------------------------------------------------------------------------- writing


def _write_shards(
    base: Path,
    shards: list[str],
    headers: dict[str, tuple[str, tuple[int, ...]]],
    plan: _Plan,
    out_dtype: torch.dtype | None,
    tmp: Path,
    progress: bool,
) -> dict[str, tuple[str, int]]:
    """Write each merged shard; returns tensor name -> (shard file, bytes)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    written: dict[str, tuple[str, int]] = {}
    bar = tqdm(
        total=len(headers), desc="merging", unit="tensor", disable=not progress, file=sys.stderr
    )
    try:
        for shard in shards:
            tensors: dict[str, torch.Tensor] = {}
            with safe_open(str(base / shard), framework="pt") as f:
                metadata = f.metadata() or {"format": "pt"}
                for name in f.keys():  # noqa: SIM118
                    tensor = f.get_tensor(name)
                    if name == plan.untie_from:
                        # The untied head starts from the embedding as it was before training.
                        tensors[_LM_HEAD] = _apply(_LM_HEAD, tensor.clone(), plan, out_dtype)
                    tensors[name] = _apply(name, tensor, plan, out_dtype)
                    bar.update(1)
            save_file(tensors, str(tmp / shard), metadata=metadata)
            for name, t in tensors.items():
                written[name] = (shard, t.numel() * t.element_size())
            del tensors  # one shard in memory at a time
    finally:
        bar.close()
    return written


def _apply(
    name: str, tensor: torch.Tensor, plan: _Plan, out_dtype: torch.dtype | None
) -> torch.Tensor:
    dtype = tensor.dtype
    if out_dtype is not None and tensor.is_floating_point():
        dtype = out_dtype
    replacement = plan.replacements.get(name)
    if replacement is not None:
        tensor = replacement
    module = plan.deltas.get(name)
    bias = plan.bias_deltas.get(name)
    if module is not None or bias is not None:
        # fp32 math: a bf16 add of a small delta loses most of its bits.
        merged = tensor.float()
        if module is not None:
            merged += module.delta_weight()
        if bias is not None:
            merged += bias
        if not torch.isfinite(merged).all():
            raise ValueError(f"merging produced NaN/inf in {name!r}; the adapter is broken")
        tensor = merged
    return tensor.to(dtype).contiguous()


def _copy_side_files(base: Path, adapter: Path, tmp: Path) -> list[str]:
    """Copy config, tokenizer, processor and other non-weight files; returns adapter-won ones."""
    for entry in sorted(base.iterdir()):
        name = entry.name
        if not entry.is_file() or name.startswith("."):
            continue  # sub-directories (caches, other formats) are not part of the model
        if name.endswith(_WEIGHT_SUFFIXES) or name in _WEIGHT_INDEXES:
            continue
        shutil.copy2(entry, tmp / name)
    from_adapter = []
    for name in _ADAPTER_TOKENIZER_FILES:
        if (adapter / name).is_file():
            shutil.copy2(adapter / name, tmp / name)
            from_adapter.append(name)
    if from_adapter:
        logger.info("using the adapter's %s", ", ".join(from_adapter))
    return from_adapter


def _update_config(config_path: Path, out_dtype: torch.dtype | None, untie: bool) -> None:
    if out_dtype is None and not untie:
        return
    config = json.loads(config_path.read_text())
    # VL configs repeat dtype / tying in the nested text config; keep the copies consistent.
    sections = [config] + [
        config[key] for key in ("text_config", "vision_config") if isinstance(config.get(key), dict)
    ]
    if out_dtype is not None:
        dtype_name = str(out_dtype).removeprefix("torch.")
        for section in sections:
            keys = [k for k in ("torch_dtype", "dtype") if k in section]
            if section is config and not keys:
                keys = ["dtype"]  # transformers 5's name (`torch_dtype` is deprecated)
            for key in keys:
                section[key] = dtype_name
    if untie:
        for section in sections:
            if section is config or "tie_word_embeddings" in section:
                section["tie_word_embeddings"] = False
    config_path.write_text(json.dumps(config, indent=2) + "\n")
