"""Reads a PEFT LoRA adapter directory into plain tensors: low-rank pairs and full tensors.

Understands `adapter_config.json` (r, lora_alpha, use_rslora, rank/alpha patterns,
target_modules, modules_to_save, fan_in_fan_out), `adapter_model.safetensors` or `.bin`, and the
`non_lora_state_dict.bin` that Qwen-VL fine-tuning repos write for trained non-LoRA parts.
Names are normalised so that adapters and checkpoints of old and new HF layouts match.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"
NON_LORA_STATE_DICT = "non_lora_state_dict.bin"

# Prefix rewrites that map the module paths of every HF layout onto one canonical form. New
# transformers nest the VL decoder (`model.language_model.layers`) and tower (`model.visual`);
# checkpoints on disk keep the old `model.layers` / `visual` names, adapters use whichever the
# training code saw.
_CANONICAL_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.visual.", "visual."),
    ("model.vision_tower.", "vision_tower."),
)
# PEFT wrapper fragments inside a parameter name that are not part of the base model's name.
_WRAPPER_FRAGMENTS = (".modules_to_save.default.", ".modules_to_save.", ".base_layer.")
_LORA_PART = re.compile(
    r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B)"
    r"(?:\.(?P<adapter>(?!weight$|bias$)[^.]+))?(?:\.(?P<param>weight|bias))?$"
)
# Trained parts of other PEFT methods: silently dropping them would give a wrong model.
_UNSUPPORTED_PARTS = ("lora_magnitude_vector", "trainable_tokens_delta", "lora_E", "ia3_l")


def canonical_name(name: str) -> str:
    """The layout-independent form of a module or tensor name (see `_CANONICAL_PREFIXES`)."""
    for old, new in _CANONICAL_PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def strip_peft_prefix(name: str) -> str:
    """`base_model.model.X` -> `X` (also the bare `base_model.` some repos save)."""
    for prefix in ("base_model.model.", "base_model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


@dataclass(frozen=True)
class LoRAConfigFile:
    """The fields of `adapter_config.json` that decide how a low-rank pair is applied."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    target_modules: list[str] | str | None = None
    modules_to_save: list[str] = field(default_factory=list)
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None
    ensure_weight_tying: bool = False  # a trained embedding stays tied to the LM head

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: Path) -> LoRAConfigFile:
        peft_type = str(data.get("peft_type", "LORA")).upper()
        if peft_type != "LORA":
            raise ValueError(f"{path}: peft_type={peft_type!r}; only LoRA adapters are supported")
        if data.get("use_dora"):
            raise ValueError(f"{path}: DoRA adapters (use_dora=true) are not supported")
        if data.get("target_parameters"):
            raise ValueError(f"{path}: target_parameters (LoRA on raw parameters) is not supported")
        if data.get("trainable_token_indices"):
            raise ValueError(f"{path}: trainable_token_indices is not supported")
        try:
            r = int(data["r"])
            alpha = float(data.get("lora_alpha", r))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: missing or invalid LoRA rank 'r' ({e})") from None
        return cls(
            r=r,
            lora_alpha=alpha,
            use_rslora=bool(data.get("use_rslora", False)),
            fan_in_fan_out=bool(data.get("fan_in_fan_out", False)),
            target_modules=data.get("target_modules"),
            modules_to_save=list(data.get("modules_to_save") or []),
            rank_pattern=dict(data.get("rank_pattern") or {}),
            alpha_pattern=dict(data.get("alpha_pattern") or {}),
            base_model_name_or_path=data.get("base_model_name_or_path"),
            ensure_weight_tying=bool(data.get("ensure_weight_tying", False)),
        )

    def rank_and_alpha(self, module: str) -> tuple[int, float]:
        """r and alpha of one module; patterns match as PEFT matches them (a name suffix)."""
        r = self.r
        alpha = self.lora_alpha
        key = _pattern_key(self.rank_pattern, module)
        if key is not None:
            r = int(self.rank_pattern[key])
        key = _pattern_key(self.alpha_pattern, module)
        if key is not None:
            alpha = float(self.alpha_pattern[key])
        return r, alpha

    def scale(self, module: str) -> float:
        r, alpha = self.rank_and_alpha(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_key(patterns: dict[str, Any], module: str) -> str | None:
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


@dataclass
class LoRAModule:
    """One targeted module: `delta = scale * B @ A` in the module's weight layout.

    `kind` is "linear" (A [r, in], B [out, r]), "embedding" (A [r, vocab], B [dim, r]) or
    "conv" (A [r, in, *kernel], B [out, r, 1...]).
    """

    name: str  # module path without the PEFT prefix, as the adapter names it
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float
    kind: str = "linear"
    fan_in_fan_out: bool = False
    lora_b_bias: torch.Tensor | None = None  # PEFT lora_bias=True: added to the base bias

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]

    def delta_shape(self) -> tuple[int, ...]:
        """The shape of the base weight this delta applies to."""
        a, b = self.lora_a, self.lora_b
        if self.kind == "embedding":
            return (a.shape[1], b.shape[0])
        if self.kind == "conv":
            return (b.shape[0], *a.shape[1:])
        shape = (b.shape[0], a.shape[1])
        return shape[::-1] if self.fan_in_fan_out else shape

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A in float32, shaped like the base weight."""
        a, b = self.lora_a.float(), self.lora_b.float()
        if self.kind == "embedding":
            return (b @ a).T * self.scale  # [vocab, dim]
        if self.kind == "conv":
            # B's kernel is 1x..x1, so the convolution of A by B is a matmul over channels.
            out = b.reshape(b.shape[0], -1) @ a.reshape(a.shape[0], -1)
            return out.reshape(self.delta_shape()) * self.scale
        delta = (b @ a) * self.scale  # [out, in]
        return delta.T if self.fan_in_fan_out else delta


@dataclass
class PeftAdapter:
    """A loaded adapter: low-rank modules plus full tensors that replace base tensors."""

    path: Path
    config: LoRAConfigFile
    modules: dict[str, LoRAModule]  # adapter module path -> pair
    # Base tensor name (PEFT prefix and wrappers stripped) -> trained tensor: modules_to_save,
    # trained biases, the non-LoRA state dict.
    full_tensors: dict[str, torch.Tensor]

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    def describe_base(self) -> str:
        base = self.config.base_model_name_or_path
        return f" (adapter_config says base_model_name_or_path={base!r})" if base else ""


def _read_adapter_tensors(path: Path) -> dict[str, torch.Tensor]:
    st_file, bin_file = path / ADAPTER_SAFETENSORS, path / ADAPTER_BIN
    if st_file.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(st_file))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{st_file}: cannot read safetensors file ({e})") from None
    if bin_file.is_file():
        return _torch_load(bin_file)
    raise FileNotFoundError(
        f"{path}: no {ADAPTER_SAFETENSORS} or {ADAPTER_BIN}; not a PEFT adapter directory"
    )


def _torch_load(file: Path) -> dict[str, torch.Tensor]:
    try:
        # weights_only: a .bin is a pickle, and pickles from the internet can run code.
        state = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several unrelated types for a bad pickle
        raise ValueError(f"{file}: cannot read torch state dict ({e})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{file}: expected a dict of tensors")
    return state


def _base_tensor_name(key: str) -> str | None:
    """Base-model name of a full tensor saved by PEFT, or None for a frozen original copy."""
    name = strip_peft_prefix(key)
    if ".original_module." in name:
        return None  # PEFT's copy of the untrained module
    for fragment in _WRAPPER_FRAGMENTS:
        name = name.replace(fragment, ".")
    return name


def load_adapter(path: str | Path) -> PeftAdapter:
    """Read a PEFT LoRA adapter directory (with `non_lora_state_dict.bin` when present)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"adapter directory {str(path)!r} does not exist")
    config_file = path / ADAPTER_CONFIG
    if not config_file.is_file():
        raise FileNotFoundError(f"{path}: no {ADAPTER_CONFIG}; not a PEFT adapter directory")
    try:
        config = LoRAConfigFile.from_dict(json.loads(config_file.read_text()), config_file)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from None

    parts: dict[str, dict[str, torch.Tensor]] = {}
    full: dict[str, torch.Tensor] = {}
    # PEFT names an embedding's pair `lora_embedding_A/B` (bare parameters, A is [r, vocab]).
    embedding_modules: set[str] = set()
    for key, tensor in _read_adapter_tensors(path).items():
        if any(p in key for p in _UNSUPPORTED_PARTS):
            raise ValueError(
                f"{path}: tensor {key!r} belongs to an unsupported PEFT variant (DoRA, trainable "
                "tokens, AdaLoRA or IA3); only plain LoRA can be merged or served"
            )
        match = _LORA_PART.match(key)
        if match is None:
            name = _base_tensor_name(key)
            if name is not None:
                full[name] = tensor
            continue
        module = strip_peft_prefix(match["module"])
        part = match["part"]
        if part.startswith("lora_embedding_"):
            embedding_modules.add(module)
            part = part.replace("embedding_", "")
        if match["param"] == "bias":
            part += "_bias"
        parts.setdefault(module, {})[part] = tensor

    non_lora = path / NON_LORA_STATE_DICT
    if non_lora.is_file():
        for key, tensor in _torch_load(non_lora).items():
            if _LORA_PART.match(key):
                continue  # some repos save LoRA pairs here too; adapter_model has them
            name = _base_tensor_name(key)
            if name is not None:
                full[name] = tensor

    modules: dict[str, LoRAModule] = {}
    for module, tensors in parts.items():
        if "lora_A" not in tensors or "lora_B" not in tensors:
            raise ValueError(f"{path}: module {module!r} has lora_A or lora_B but not both")
        a, b = tensors["lora_A"], tensors["lora_B"]
        if module in embedding_modules:
            kind = "embedding"
        else:
            kind = "conv" if a.dim() > 2 else "linear"
        r, _ = config.rank_and_alpha(module)
        if a.shape[0] != r or b.shape[1] != r:
            raise ValueError(
                f"{path}: module {module!r} has lora_A {tuple(a.shape)} / lora_B "
                f"{tuple(b.shape)}, which does not match rank r={r} of adapter_config.json"
            )
        modules[module] = LoRAModule(
            name=module,
            lora_a=a,
            lora_b=b,
            scale=config.scale(module),
            kind=kind,
            fan_in_fan_out=config.fan_in_fan_out and kind == "linear",
            lora_b_bias=tensors.get("lora_B_bias"),
        )
    if not modules and not full:
        raise ValueError(f"{path}: the adapter holds no LoRA weights")
    return PeftAdapter(path=path, config=config, modules=modules, full_tensors=full)
