"""Builds a model from a `ModelConfig` and fills its weights.

Load formats: "auto" / "safetensors" (a HF directory of `*.safetensors`, sharded or not, read
one file at a time), "gguf" (dequantized to HF-named tensors by transformers' GGUF reader once,
then read from the user cache: `pagoda.model_files.GGUFCache`) and
"dummy" (deterministic random weights from the config alone, for benchmarks with real shapes).
The model is built directly in the target dtype on the target device and returned in eval mode.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagoda.config import ModelConfig
from pagoda.layers.embedding import LMHead
from pagoda.layers.linear import LinearBase
from pagoda.models.registry import architectures_of, get_model_class

if TYPE_CHECKING:
    from pagoda.model_files import GGUFCache

_INDEX_FILE = "model.safetensors.index.json"
# Dummy weights: small enough that activations stay O(1) through every layer, large enough that
# logits are well separated and greedy decoding does not flip on rounding noise.
_DUMMY_RANGE = 0.05


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: those named by the shard index, else every *.safetensors."""
    index_path = model_dir / _INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index_path}: not a valid safetensors index ({e})") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ValueError(f"{file}: listed in {_INDEX_FILE} but missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files found")
    return files


def iter_safetensors_weights(
    model_dir: str | os.PathLike[str], device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from a HF checkpoint directory, one file open at a time."""
    from safetensors import SafetensorError, safe_open

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"{model_dir}: model directory does not exist")
    for file in _safetensors_files(model_dir):
        # Consumer exceptions are raised in the caller's frame, never inside this try, so only
        # read errors of this file are rewritten.
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file}: cannot read safetensors file ({e})") from e


def iter_gguf_weights(model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield HF-named, dequantized tensors of `model_config.gguf_file`.

    The first run dequantizes (seconds to minutes) and caches the result as safetensors; later
    runs read that file (memory-mapped) instead.
    """
    from pagoda.model_files import gguf_cache

    gguf_path = model_config.gguf_file
    if gguf_path is None:
        raise ValueError('load_format="gguf" needs ModelConfig.gguf_file')
    if not os.path.isabs(gguf_path) and not os.path.isfile(gguf_path):
        gguf_path = os.path.join(model_config.model, gguf_path)
    if not os.path.isfile(gguf_path):
        raise ValueError(f"{gguf_path}: GGUF file not found")
    cache = gguf_cache(gguf_path)
    if cache is not None and cache.weights_file.is_file():
        tensors = _read_cached(cache.weights_file)
        if tensors is not None:
            yield from tensors
            return
    tensors = _dequantize_gguf(gguf_path, model_config)
    if cache is not None:
        _cache_tensors(cache, tensors, gguf_path)
    while tensors:
        # Pop so each dequantized float32 tensor is freed once copied into the model.
        name = next(iter(tensors))
        yield name, tensors.pop(name)


def _dequantize_gguf(gguf_path: str, model_config: ModelConfig) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from pagoda.model_files import transformers_config

    # transformers maps GGUF tensor names through an HF model's state_dict; a meta-device
    # instance gives it the names without allocating memory.
    with torch.device("meta"):
        hf_skeleton = AutoModelForCausalLM.from_config(transformers_config(model_config.hf_config))
    try:
        parsed = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=hf_skeleton)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"{gguf_path}: cannot read GGUF checkpoint ({e})") from e
    return parsed["tensors"]


def _read_cached(path: Path) -> Iterator[tuple[str, torch.Tensor]] | None:
    """The cached tensors, read one at a time; None (and the file removed) when its header is
    unreadable (a damaged cache entry is rebuilt, not fatal)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
    except (SafetensorError, OSError) as e:
        print(f"note: {path} is unreadable ({e}); converting the GGUF file again", file=sys.stderr)
        path.unlink(missing_ok=True)
        return None

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)

    return tensors()


def _cache_tensors(cache: GGUFCache, tensors: dict[str, torch.Tensor], gguf_path: str) -> None:
    from safetensors.torch import save_file

    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

    def write(tmp: Path) -> None:
        # Leave 1 GiB spare: filling the disk to save start-up time is a bad trade.
        free = shutil.disk_usage(tmp.parent).free
        if free < nbytes + (1 << 30):
            raise OSError(f"{nbytes / 2**20:.0f} MiB needed, {free / 2**20:.0f} MiB free")
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp))

    if cache.store(cache.weights_file, write):
        print(
            f"note: dequantized {Path(gguf_path).name} once; cached {nbytes / 2**20:.0f} MiB in "
            f"{cache.directory} so later starts skip it",
            file=sys.stderr,
        )


def _init_dummy_weights(model: nn.Module, seed: int, device: torch.device) -> None:
    """Deterministic random weights: U(±r) for matrices and biases, 1 + U(±r) for norms."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            continue  # packed quantized weights are not drawn here
        data = param.data
        if data.device != device:  # kept on the host (cpu_offload_gb): the same draws
            data = torch.empty_like(data, device=device)
        data.uniform_(-_DUMMY_RANGE, _DUMMY_RANGE, generator=generator)
        if data.dim() == 1 and name.endswith("norm.weight"):
            data.add_(1.0)
        if data is not param.data:
            param.data.copy_(data)


def load_model(
    model_config: ModelConfig,
    device: torch.device | str,
    keep_on_host: Callable[[nn.Module], Sequence[nn.Module]] | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Build the model of `model_config` on `device` and load its weights (eval mode).

    `keep_on_host(model)` names submodules (decoder layers, for cpu_offload_gb) that stay in
    host memory: the model is then built on the CPU and only the rest moves to `device`, so a
    model larger than the device never has to fit on it. `prepare(model)` runs on the built
    model before its weights load (tensor parallelism shards the loaders there)."""
    device = torch.device(device)
    model_cls = get_model_class(architectures_of(model_config.hf_config))
    dtype = getattr(torch, model_config.dtype)
    kwargs = {}
    if model_config.quantization is not None:
        # The checkpoint's quantization_config (never file names) picks each layer's method.
        from pagoda.layers.quantized_linear import make_linear_method_factory

        kwargs["linear_method_factory"] = make_linear_method_factory(
            model_config.quantization, getattr(model_cls, "packed_modules_mapping", {})
        )
    build_device = device if keep_on_host is None else torch.device("cpu")
    with _default_dtype(dtype), build_device:
        model = model_cls(model_config.hf_config, **kwargs)
    if keep_on_host is not None:
        _move_except(model, set(map(id, keep_on_host(model))), device)
    if prepare is not None:
        prepare(model)

    load_format = model_config.load_format
    if load_format == "dummy":
        _init_dummy_weights(model, model_config.seed, device)
        generator = torch.Generator(device=device).manual_seed(model_config.seed)
        for module in model.modules():
            # Quantized methods draw their integer codes themselves.
            init = getattr(getattr(module, "linear_method", None), "init_dummy_weights", None)
            if isinstance(module, (LinearBase, LMHead)) and init is not None:
                init(module, generator)
    elif load_format == "gguf" or (load_format == "auto" and model_config.gguf_file):
        model.load_weights(iter_gguf_weights(model_config))
    elif load_format in ("auto", "safetensors"):
        model.load_weights(iter_safetensors_weights(model_config.model))
    else:
        raise ValueError(f"load_format={load_format!r} is not supported")

    for module in model.modules():
        # A quantized LM head holds its method like a linear layer (dense heads have none).
        method = getattr(module, "linear_method", None)
        if isinstance(module, (LinearBase, LMHead)) and method is not None:
            method.process_weights_after_loading(module)
    return model.eval()


def _move_except(model: nn.Module, host_ids: set[int], device: torch.device) -> None:
    """`model.to(device)` except for the submodules in `host_ids` (detached while it runs)."""
    kept: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in host_ids:
                kept.append((parent, name, child))
                parent._modules[name] = None
    model.to(device)
    for parent, name, child in kept:
        parent._modules[name] = child
