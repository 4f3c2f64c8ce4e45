"""Sequential layer-by-layer calibration: the model is never whole in device memory.

pagoda's own model is built on the meta device; the embeddings of every calibration sample
are captured once; then per decoder layer: its weights alone are loaded onto the device, a
pass accumulates one Hessian per linear input (q/k/v share one, gate/up share one), each
projection is quantized (GPTQ or RTN), a second pass through the quantized layer produces
the next layer's inputs, and the layer goes back to meta. Quantized tensors wait on the CPU.
AWQ keeps that pass's linear inputs instead: it searches and folds the channel scales of each
`SmoothMapping` (the layer's math unchanged), clips the weights, then rounds them (RTN); the
rescaled norms are written too.

The LM head, when quantized (not ignored, embeddings untied), comes last: the final norm of
the decoder runs on the quantized decoder's outputs, its outputs give lm_head's Hessian, and
lm_head is quantized with the same scheme (RTN needs no Hessian).

Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) go the same way through their text
decoder (`model.language_model`); the vision tower is never quantized. Calibration samples with
images or videos run them through the tower first (unquantized, loaded once, then dropped):
its outputs replace the placeholder rows of layer 0's inputs, the samples' M-RoPE positions
drive every layer, and Qwen3-VL's DeepStack features are added after the first layers, so the
statistics see the image tokens as serving does. Names inside the pipeline are pagoda's module
names (transformers 5's); `WeightSource` maps them to and from the checkpoint's own layout.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagoda.layers.linear import LinearBase
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import get_rope
from pagoda.multimodal.image_processor import ImageProcessorConfig
from pagoda.multimodal.inputs import MultiModalInputs
from pagoda.quant.formats.autoawq import pack_awq_gemm
from pagoda.quant.formats.compressed_tensors import compress
from pagoda.quant.fp8 import Fp8Args
from pagoda.quant.weights import QuantizedWeight, WeightQuantArgs
from pagoda.quantizer.awq import (
    AWQOptions,
    ScaleSearch,
    activation_mean,
    apply_clip,
    search_clip,
    search_scales,
)
from pagoda.quantizer.awq_guard import (
    RoundedTarget,
    choose,
    evaluation_samples,
    layer_error,
    rounded_weights,
)
from pagoda.quantizer.fp8 import AmaxObserver, KVScaleObserver, fp8_tensors, quantize_fp8_shards
from pagoda.quantizer.gptq import HessianAccumulator, gptq_quantize
from pagoda.quantizer.guided import fused_token_weights
from pagoda.quantizer.refine import RefineReport, RefineTarget, refine_layer
from pagoda.quantizer.rtn import hessian_weighted_error, rtn_quantize
from pagoda.worker.encoder_runner import patchify

# Architectures whose decoder layers the pipeline knows how to run (the Llama skeleton).
QUANTIZABLE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "MistralForCausalLM",
)
METHODS = ("gptq", "rtn", "awq")
FORMATS = ("compressed-tensors", "autoawq")
_CANDIDATE_GROUPS = (32, 64, 128, 256)


# ---------------------------------------------------------------- weights by name


class WeightSource:
    """Checkpoint tensors by module name, read when asked (safetensors) or held (GGUF).

    `rename` maps a checkpoint name to pagoda's module name (a VL release checkpoint's
    `visual.*` / `model.layers.*` -> `model.visual.*` / `model.language_model.layers.*`);
    `checkpoint_name` maps back, so that the output keeps the input's naming.
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor] | None = None,
        files: dict[str, Path] | None = None,
        checkpoint_names: dict[str, str] | None = None,
    ) -> None:
        self._tensors = tensors or {}
        self._files = files or {}
        self._dummy: dict[str, tuple[int, tuple[int, ...]]] = {}  # name -> (seed, shape)
        self._checkpoint_names = checkpoint_names or {}  # module name -> checkpoint name

    @classmethod
    def from_model_config(
        cls, model_config: Any, rename: Callable[[str], str] | None = None
    ) -> WeightSource:
        from pagoda.models.loader import _safetensors_files, iter_gguf_weights

        checkpoint_names: dict[str, str] = {}

        def module_name(name: str) -> str:
            ours = rename(name) if rename is not None else name
            if ours in checkpoint_names and checkpoint_names[ours] != name:
                raise ValueError(
                    f"checkpoint tensors {checkpoint_names[ours]} and {name} are the same "
                    f"parameter ({ours}); the checkpoint mixes two naming layouts"
                )
            checkpoint_names[ours] = name
            return ours

        if model_config.gguf_file:
            tensors = {module_name(n): t for n, t in iter_gguf_weights(model_config)}
            return cls(tensors=tensors, checkpoint_names=checkpoint_names)
        from safetensors import SafetensorError, safe_open

        files = {}
        for file in _safetensors_files(Path(model_config.model)):
            try:
                with safe_open(str(file), framework="pt") as f:
                    names = list(f.keys())
            except (SafetensorError, OSError) as e:
                raise ValueError(
                    f"{file}: not a readable safetensors file ({e}); it is probably truncated "
                    "(an interrupted copy or download): copy it again"
                ) from None
            for name in names:
                files[module_name(name)] = file
        return cls(files=files, checkpoint_names=checkpoint_names)

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's own name of the tensor `name` (a module name)."""
        return self._checkpoint_names.get(name, name)

    @classmethod
    def dummy(cls, skeleton: nn.Module, seed: int = 0) -> WeightSource:
        """Deterministic random HF-named weights for a `config:` model (timing runs)."""
        source = cls()
        mapping = skeleton.packed_modules_mapping
        shapes: dict[str, tuple[int, ...]] = {}
        for name, param in skeleton.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            parent, _, short = module_name.rpartition(".")
            module = skeleton.get_submodule(module_name)
            if short in mapping and isinstance(module, LinearBase):
                for hf, size in zip(mapping[short], module.out_features_per_shard):
                    shapes[f"{parent}.{hf}.{leaf}"] = (size, *param.shape[1:])
            else:
                shapes[name] = tuple(param.shape)
        source._dummy = {n: (seed + i, shapes[n]) for i, n in enumerate(sorted(shapes))}
        return source

    def names(self) -> list[str]:
        return sorted(set(self._tensors) | set(self._files) | set(self._dummy))

    def get(self, name: str) -> torch.Tensor:
        if name in self._tensors:
            return self._tensors[name]
        if name in self._dummy:
            seed, shape = self._dummy[name]
            g = torch.Generator().manual_seed(seed)
            if name.endswith("norm.weight"):
                return 1.0 + 0.05 * torch.rand(shape, generator=g)
            return (torch.rand(shape, generator=g) - 0.5) * 0.1
        from safetensors import safe_open

        with safe_open(str(self._files[name]), framework="pt") as f:
            return f.get_tensor(self.checkpoint_name(name))

    def with_prefix(self, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names():
            if name.startswith(prefix):
                yield name, self.get(name)


# ---------------------------------------------------------------- which modules


def matches_ignore(name: str, patterns: list[str]) -> bool:
    """llmcompressor's rule: `re:` patterns match at the start of the dotted name, else exact."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern:
            return True
    return False


def is_ignored(model: nn.Module, name: str, patterns: list[str]) -> bool:
    """`matches_ignore` on the module name, or on its original-release name (VL models).

    llmcompressor matches transformers' module names (`model.language_model.layers.0...`,
    `model.visual...`); users reading a release checkpoint write `model.layers.0...` or
    `visual...`. Either spelling keeps the module dense.
    """
    if matches_ignore(name, patterns):
        return True
    original = getattr(model, "module_to_original_name", None)
    return original is not None and matches_ignore(original(name), patterns)


def decoder_of(model: nn.Module) -> tuple[nn.Module, str]:
    """The text decoder (`embed_tokens`, `layers`, `norm`) and its module name.

    `model.model` of a causal LM, `model.model.language_model` of a vision-language model.
    """
    decoder = getattr(model, "language_model", None)
    if decoder is None:
        decoder = model.model
    for name, module in model.named_modules():
        if module is decoder:
            return decoder, name
    raise ValueError(f"{type(model).__name__}: decoder not found among its modules")


def linear_module_names(model: nn.Module) -> list[str]:
    """Every HF linear module of `model` in module order (fused layers expanded), lm_head last."""
    mapping = model.packed_modules_mapping
    names = []
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            parent, _, leaf = name.rpartition(".")
            names.extend(f"{parent}.{h}" if parent else h for h in mapping.get(leaf, [leaf]))
    return [*names, "lm_head"]


def quantizes_lm_head(model: nn.Module, ignore: list[str]) -> bool:
    """Whether the pipeline quantizes lm_head: `ignore` does not cover it and it is untied.

    A head tied to the embeddings stays dense (quantizing it would quantize the embedding
    table too, which neither pagoda nor compressed-tensors serves).
    """
    return not getattr(model, "tie_word_embeddings", False) and not is_ignored(
        model, "lm_head", ignore
    )


def dense_module_names(model: nn.Module, ignore: list[str]) -> list[str]:
    """The linear modules the pipeline leaves unquantized, as llmcompressor lists them.

    Everything outside the decoder layers (the vision tower, lm_head unless it is quantized)
    and the ignored decoder projections: compressed-tensors writes exactly these module names
    into `ignore`.
    """
    _, prefix = decoder_of(model)
    layers = f"{prefix}.layers."
    head_dense = not quantizes_lm_head(model, ignore)
    return [
        n
        for n in linear_module_names(model)
        if (head_dense if n == "lm_head" else not n.startswith(layers))
        or is_ignored(model, n, ignore)
    ]


@dataclass(frozen=True)
class TargetLinear:
    """One pagoda linear layer of a decoder layer and the HF modules stored in it."""

    attr: str  # path inside the decoder layer, e.g. "self_attn.qkv_proj"
    hf_names: list[str]  # full HF names of its output shards, in order
    quantized: list[bool]  # per shard: quantized (else kept dense: --ignore)


def layer_targets(model: nn.Module, layer_index: int, ignore: list[str]) -> list[TargetLinear]:
    decoder, decoder_name = decoder_of(model)
    prefix = f"{decoder_name}.layers.{layer_index}"
    layer = decoder.layers[layer_index]
    mapping = model.packed_modules_mapping
    targets = []
    for attr, module in layer.named_modules():
        if not isinstance(module, LinearBase):
            continue
        parent, _, leaf = attr.rpartition(".")
        base = f"{prefix}.{parent}" if parent else prefix
        hf_names = [f"{base}.{h}" for h in mapping.get(leaf, [leaf])]
        targets.append(
            TargetLinear(attr, hf_names, [not is_ignored(model, n, ignore) for n in hf_names])
        )
    return targets


@dataclass(frozen=True)
class SmoothMapping:
    """One AWQ scale search in a decoder layer (attribute paths of pagoda's modules).

    `linear` reads the output of `prev`: an RMSNorm, or the shard `prev_shard` of a fused
    linear (v_proj of qkv_proj, up_proj of gate_up_proj). Its input channels are multiplied by
    s and `prev`'s outputs divided by s; `inspect` is the module whose output error scores s.
    """

    prev: str
    linear: str
    inspect: str
    prev_shard: str | None = None


# pagoda's Llama skeleton (Llama, Qwen2/3, Mistral, the Qwen2-VL / 2.5-VL text decoder): the
# four smoothings of AutoAWQ and llmcompressor. v_proj -> o_proj applies only where v's output
# is o_proj's input channel for channel (as many KV heads as heads).
DECODER_AWQ_MAPPINGS = (
    SmoothMapping("input_layernorm", "self_attn.qkv_proj", "self_attn"),
    SmoothMapping("self_attn.qkv_proj", "self_attn.o_proj", "self_attn.o_proj", "v_proj"),
    SmoothMapping("post_attention_layernorm", "mlp.gate_up_proj", "mlp"),
    SmoothMapping("mlp.gate_up_proj", "mlp.down_proj", "mlp.down_proj", "up_proj"),
)
AWQ_MAPPINGS = {arch: DECODER_AWQ_MAPPINGS for arch in QUANTIZABLE_ARCHITECTURES}
# AutoAWQ does not clip q/k: their error passes through the q·k product, which the
# per-linear clip loss does not see.
_AWQ_UNCLIPPED = ("q_proj", "k_proj")


def _quantized_inputs(model: nn.Module, ignore: list[str]) -> dict[int, list[str]]:
    """Input size -> the names of the quantized modules that read it."""
    sizes: dict[int, list[str]] = {}
    layers = decoder_of(model)[0].layers
    for i in range(len(layers)):
        for t in layer_targets(model, i, ignore):
            if any(t.quantized):
                in_features = layers[i].get_submodule(t.attr).in_features
                sizes.setdefault(in_features, []).extend(
                    n for n, q in zip(t.hf_names, t.quantized) if q
                )
    if quantizes_lm_head(model, ignore):
        sizes.setdefault(model.lm_head.hidden_size, []).append("lm_head")
    return sizes


def default_group_size(model: nn.Module, ignore: list[str], preferred: int = 128) -> int:
    """`preferred` when it divides every quantized layer's input, else the largest smaller
    candidate that does (SmolLM2's 576 = 9 x 64 takes 64), else -1 (per channel)."""
    sizes = list(_quantized_inputs(model, ignore))
    for g in sorted((g for g in _CANDIDATE_GROUPS if g <= preferred), reverse=True):
        if all(s % g == 0 for s in sizes):
            return g
    return -1


def check_group_size(model: nn.Module, args: WeightQuantArgs, ignore: list[str]) -> None:
    """One error naming every layer whose input size the group size does not divide."""
    if args.group_size == -1:
        return
    bad = {
        size: names
        for size, names in _quantized_inputs(model, ignore).items()
        if size % args.group_size
    }
    if not bad:
        return
    sizes = sorted(bad)
    working = [g for g in _CANDIDATE_GROUPS if all(s % g == 0 for s in sizes)]
    names = [n for ns in bad.values() for n in ns]
    kinds = sorted({n.rsplit(".", 1)[-1] for n in names})
    suggestion = " or ".join(f"--group-size {g}" for g in working[-2:])
    suggestion = f"{suggestion} or -1 (per channel)" if working else "--group-size -1 (per channel)"
    # Short on purpose: one size and a few module kinds say what is wrong; the fix is a
    # group size that divides every input (listing an --ignore for each layer helps nobody).
    raise ValueError(
        f"group size {args.group_size} does not divide the input size "
        f"({', '.join(str(s) for s in sizes)}) of {len(names)} layer(s) "
        f"({', '.join(kinds[:4])}{', ...' if len(kinds) > 4 else ''}); use {suggestion}"
    )


def check_ignore_matches(model: nn.Module, ignore: list[str], patterns: list[str]) -> None:
    """Every pattern of `patterns` (the user's ignore list) must keep at least one linear
    module dense: a typo would otherwise quantize the layer it was meant to keep, silently."""
    names = linear_module_names(model)
    unmatched = [p for p in patterns if not any(is_ignored(model, n, [p]) for n in names)]
    if not unmatched:
        return
    example = next((n for n in names if ".layers.0." in n), names[0])
    raise ValueError(
        f"--ignore {' '.join(repr(p) for p in unmatched)} matches no linear module (a typo?); "
        f"patterns are exact module names or 're:' regexes matched at the start of the name, "
        f"e.g. {example!r} or 're:.*mlp.*'"
    )


# ---------------------------------------------------------------- report


@dataclass
class ModuleReport:
    name: str
    shape: tuple[int, int]  # (out, in)
    # tr(ΔW H ΔWᵀ) / tr(W H Wᵀ): the layer-output error on calibration data (AWQ: on the
    # samples its searches scored)
    relative_error: float
    loss: float | None  # GPTQ's own loss (None for RTN)
    seconds: float


@dataclass
class SmoothReport:
    """One AWQ scale search: the winning exponent and the inspected module's output MSE."""

    prev: str  # e.g. "model.layers.3.input_layernorm"
    linear: str
    ratio: float | None  # None: s = 1 (no smoothing) won
    loss: float
    initial_loss: float  # with s = 1


@dataclass
class LayerReport:
    index: int
    seconds: float
    modules: list[ModuleReport] = field(default_factory=list)
    smoothing: list[SmoothReport] = field(default_factory=list)  # AWQ only
    # AWQ only: the guard's pick ("scales+clip", "scales" or "rtn") and each candidate's
    # layer-output MSE on the scored calibration samples (see awq_guard).
    awq_choice: str | None = None
    awq_errors: dict[str, float] = field(default_factory=dict)
    refine: RefineReport | None = None  # --refine-steps: the layer output before / after


@dataclass
class QuantizeReport:
    method: str
    scheme: str
    group_size: int
    num_samples: int
    num_tokens: int
    device: str
    num_vision_tokens: int = 0  # image / video tokens among num_tokens (vision tower outputs)
    calibration_dtype: str = "float32"  # of the calibration forward passes
    layers: list[LayerReport] = field(default_factory=list)
    seconds: float = 0.0
    rtn_fallbacks: list[str] = field(default_factory=list)
    lm_head: ModuleReport | None = None  # set when lm_head is quantized
    notes: list[str] = field(default_factory=list)  # e.g. a tied lm_head kept dense (stderr too)
    # What made the checkpoint: calibration file (path, sha256, bytes), ignore list, seed.
    dataset: dict[str, Any] | None = None
    ignore: list[str] = field(default_factory=list)
    seed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        lines = [
            f"{self.method} {self.scheme} group {self.group_size}: {len(self.layers)} layers, "
            f"{self.num_samples} samples / {self.num_tokens} tokens"
            + (f" ({self.num_vision_tokens} image/video)" if self.num_vision_tokens else "")
            + f", {self.seconds:.1f} s on {self.device} ({self.calibration_dtype} forward)",
            f"{'layer':>5} {'seconds':>8} {'worst module':<40} {'rel. error':>10}",
        ]
        for layer in self.layers:
            worst = max(layer.modules, key=lambda m: m.relative_error, default=None)
            if worst is None:
                lines.append(f"{layer.index:>5} {layer.seconds:>8.2f} {'-':<40}")
                continue
            short = worst.name.split(f"layers.{layer.index}.", 1)[-1]
            refine = ""
            if layer.refine is not None:  # the layer output MSE after ÷ before (1 when not kept)
                r = layer.refine
                kept = r.after if r.kept else r.before
                refine = f"  refined {kept / max(r.before, 1e-30):.3f}x"
            lines.append(
                f"{layer.index:>5} {layer.seconds:>8.2f} {short:<40} {worst.relative_error:>10.4g}"
                + refine
            )
        if self.lm_head is not None:
            lines.append(
                f"{'head':>5} {self.lm_head.seconds:>8.2f} {'lm_head':<40} "
                f"{self.lm_head.relative_error:>10.4g}"
            )
        if self.rtn_fallbacks:
            lines.append(
                f"RTN fallback (Hessian not factorisable): {', '.join(self.rtn_fallbacks)}"
            )
        return "\n".join(lines)


# ---------------------------------------------------------------- the pipeline


@dataclass(frozen=True)
class PipelineOptions:
    method: str = "gptq"
    block_size: int = 128
    dampening: float = 0.01
    device: torch.device = torch.device("cpu")
    compute_dtype: torch.dtype = torch.float32  # forward passes
    storage_dtype: torch.dtype = torch.bfloat16  # scales written to the checkpoint
    progress: bool = True
    gptq_scales: str = "first_touch"  # or "upfront" (see gptq_quantize)
    awq: AWQOptions = AWQOptions()
    format: str = "compressed-tensors"  # or "autoawq" (AutoAWQ GEMM tensors)
    refine_steps: int = 0  # GPTQ / RTN: sign-gradient steps on the layer output (refine.py)

    @property
    def scale_dtype(self) -> torch.dtype:
        """What scales are rounded to before codes are computed: AutoAWQ stores float16."""
        return torch.float16 if self.format == "autoawq" else self.storage_dtype


def _load_layer(
    model: nn.Module,
    layer: nn.Module,
    index: int,
    source: WeightSource,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Materialise one decoder layer on `device` and fill it from the checkpoint."""
    # Moving off meta makes new Parameter objects: carry over the loader tags (weight_loader,
    # output_dim, output_pack_factor) the fused layers put on them.
    tags = {name: {k: v for k, v in vars(p).items()} for name, p in layer.named_parameters()}
    layer.to_empty(device=device)
    for name, p in layer.named_parameters():
        for key, value in tags[name].items():
            setattr(p, key, value)
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    _fill_module(model, layer, f"{decoder_of(model)[1]}.layers.{index}.", source, f"layer {index}")


def _fill_module(
    model: nn.Module, module: nn.Module, prefix: str, source: WeightSource, what: str
) -> None:
    """Load every checkpoint tensor under `prefix` (module names) into `module`'s parameters
    (fused shards through their loaders); ValueError for strays and for missing weights."""
    params = {prefix + n: p for n, p in module.named_parameters(remove_duplicate=False)}
    seen = set()
    for name, tensor in source.with_prefix(prefix):
        if name.endswith(("rotary_emb.inv_freq", "rotary_pos_emb.inv_freq")):
            continue
        param_name, shard = model._param_name_and_shard(name)
        param = params.get(param_name)
        if param is None:
            raise ValueError(f"checkpoint tensor {name} matches no parameter of {what}")
        tensor = tensor.to(device=param.device, dtype=param.dtype)
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            param.data.copy_(tensor)
        elif shard is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard)
        seen.add(param_name)
    missing = [n for n in params if n not in seen]
    if missing:
        raise ValueError(f"checkpoint is missing weights of {what}: {', '.join(missing)}")


def text_positions(num_tokens: int, device: torch.device | str) -> torch.Tensor:
    """Rotary positions [T] of a text-only sequence, as the model runner passes them.

    Vision-language models: text tokens sit at (i, i, i) on M-RoPE's three axes (HF's
    `get_rope_index`, pagoda's `mrope_positions`), which is plain RoPE at i, and the runner
    collapses text-only steps to these [T] positions; `MRotaryEmbedding` takes both forms.
    """
    return torch.arange(num_tokens, device=device)


Positions = list[torch.Tensor | None]  # per sample: [3, T] M-RoPE positions, None for text


def _positions(x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    return text_positions(x.shape[0], x.device) if positions is None else positions


def _run_layer(
    layer: nn.Module, inputs: list[torch.Tensor], positions: Positions | None = None
) -> list[torch.Tensor]:
    """Each sample through one decoder layer; returns hidden + residual, the next input."""
    positions = positions or [None] * len(inputs)
    outputs = []
    for hidden, pos in zip(inputs, positions, strict=True):
        out, residual = layer(_positions(hidden, pos), hidden, None, None)
        outputs.append(out + residual)
    return outputs


@dataclass
class VisionRows:
    """One sample's image / video tokens: their rows and the vision tower's outputs there."""

    rows: torch.Tensor  # [n] long, rows of the sample
    embeds: torch.Tensor  # [n, hidden]: layer 0's inputs at those rows
    deepstack: torch.Tensor | None  # [n, k, hidden]: added after decoder layers 0..k-1


@dataclass
class CalibrationState:
    """What the next decoder layer reads: each sample's hidden states [T, hidden], its
    positions, and its vision rows (DeepStack features still to add)."""

    hidden_states: list[torch.Tensor]
    positions: Positions | None  # None: every sample is text
    vision: list[VisionRows | None]

    @classmethod
    def start(
        cls,
        model: nn.Module,
        source: WeightSource,
        samples: list[torch.Tensor],
        mm_inputs: list[MultiModalInputs | None],
        image_config: ImageProcessorConfig | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> CalibrationState:
        """Layer 0's inputs: token embeddings, image / video rows from the vision tower."""
        hidden_states = layer_inputs(model, source, samples, device, dtype)
        if not any(mm is not None for mm in mm_inputs):
            return cls(hidden_states, None, [])
        if image_config is None:
            raise ValueError("samples with images need the model's image_config")
        vision = vision_rows(model, source, samples, mm_inputs, image_config, device, dtype)
        positions: Positions = [None] * len(samples)
        for i, (ids, mm, v) in enumerate(zip(samples, mm_inputs, vision, strict=True)):
            if mm is not None:
                positions[i] = torch.from_numpy(mm.mrope_positions[:, : ids.numel()]).to(device)
            if v is not None:
                hidden_states[i][v.rows] = v.embeds
        return cls(hidden_states, positions, vision)

    def advance(self, layer: nn.Module, index: int) -> None:
        """Run decoder layer `index`: its outputs (plus DeepStack features) become the state."""
        with torch.no_grad():
            self.hidden_states = _run_layer(layer, self.hidden_states, self.positions)
        for h, v in zip(self.hidden_states, self.vision):
            if v is not None and v.deepstack is not None and index < v.deepstack.shape[1]:
                h[v.rows] += v.deepstack[:, index]  # Qwen3-VL: after the first layers


def _module_name(model: nn.Module, target: nn.Module) -> str:
    return next(name for name, module in model.named_modules() if module is target)


def vision_rows(
    model: nn.Module,
    source: WeightSource,
    samples: list[torch.Tensor],
    mm_inputs: list[MultiModalInputs | None],
    image_config: ImageProcessorConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> list[VisionRows | None]:
    """The vision tower (unquantized, built on `device` for this call only) over each
    sample's images and videos, as the model runner encodes them (`patchify`, `embed_images`
    layout: main | DeepStack columns); items past a truncated sample's end are skipped."""
    hidden = model.config.hidden_size
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as the loader builds it: rotary tables stay float32
    try:
        with torch.device(device):
            tower = model.new_vision_tower()
    finally:
        torch.set_default_dtype(previous)
    _fill_module(model, tower, _module_name(model, model.visual) + ".", source, "the vision tower")
    out: list[VisionRows | None] = []
    for ids, mm in zip(samples, mm_inputs, strict=True):
        n = int(ids.numel())
        kept = (
            [(item, off, k) for item, (off, k) in zip(mm.items, mm.placeholders) if off < n]
            if mm
            else []
        )
        if not kept:
            out.append(None)
            continue
        pixels = [torch.from_numpy(item.pixels).to(device) for item, _, _ in kept]
        pixel_values = torch.cat([patchify(p, image_config, dtype) for p in pixels])
        with torch.no_grad():
            embeds = tower(pixel_values, [item.grid_thw for item, _, _ in kept])  # [N, H*(1+k)]
        rows = torch.cat([torch.arange(off, off + k) for _, off, k in kept]).to(device)
        inside = rows < n
        rows, embeds = rows[inside], embeds[inside].to(dtype)
        deepstack = None
        if embeds.shape[1] > hidden:
            deepstack = embeds[:, hidden:].reshape(rows.shape[0], -1, hidden)
        out.append(VisionRows(rows, embeds[:, :hidden], deepstack))
    del tower
    return out


def layer_inputs(
    model: nn.Module,
    source: WeightSource,
    samples: list[torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Inputs of decoder layer 0: the token embeddings of every sample, each [T, hidden]."""
    _, prefix = decoder_of(model)
    embed = source.get(f"{prefix}.embed_tokens.weight").to(device=device, dtype=dtype)
    return [embed[ids.to(device)] for ids in samples]


def calibration_rope(model: nn.Module, device: torch.device) -> nn.Module:
    """The decoder's rotary embedding, built on `device` (the meta model's has no tables).

    Built as `DecoderModel` builds it (`get_rope` of the text config), so a VL model gets the
    same `MRotaryEmbedding` (mrope_section) it serves with.
    """
    decoder, _ = decoder_of(model)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    with torch.device(device):
        rope = get_rope(config, head_dim)
    if type(rope) is not type(decoder.rotary_emb):
        raise TypeError(
            f"calibration rotary {type(rope).__name__} differs from the model's "
            f"{type(decoder.rotary_emb).__name__}"
        )
    return rope


def _quantize_matrix(
    w: torch.Tensor,
    hessian: torch.Tensor | None,  # None only for RTN without calibration data
    args: WeightQuantArgs,
    options: PipelineOptions,
    report: QuantizeReport,
    name: str,
) -> tuple[QuantizedWeight, torch.Tensor, float | None, torch.Tensor | None]:
    """GPTQ or RTN of one float32 [out, in] matrix: (quantized, dequantized, GPTQ loss, the
    values its codes round: GPTQ's error-updated weights when refining, RTN's own).

    AWQ rounds its smoothed, clipped weights with RTN."""
    if options.method == "gptq":
        result = gptq_quantize(
            w,
            hessian,
            args,
            options.block_size,
            options.dampening,
            options.scale_dtype,
            options.gptq_scales,
            keep_unrounded=options.refine_steps > 0,
        )
        if result.used_rtn_fallback:
            report.rtn_fallbacks.append(name)
        return result.quantized, result.dequantized, result.loss, result.unrounded
    qw = rtn_quantize(w, args, options.scale_dtype)
    return qw, qw.dequantize(torch.float32), None, w


def pack_module(qw: QuantizedWeight, args: WeightQuantArgs, options: PipelineOptions):
    """One module's checkpoint tensors (names relative to the module) in `options.format`."""
    if options.format == "autoawq":
        qweight, qzeros, scales = pack_awq_gemm(
            qw.qweight, qw.scale, qw.zero_point, options.scale_dtype
        )
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    return compress(qw, args, options.storage_dtype)


# ---------------------------------------------------------------- AWQ


def _capture_inputs(
    layer: nn.Module,
    attrs: list[str],
    hidden_states: list[torch.Tensor],
    positions: Positions | None = None,
    keep: Sequence[int] | None = None,
    means: dict[str, torch.Tensor] | None = None,
) -> dict[str, list[torch.Tensor]]:
    """The input of each linear `attrs` on every sample (each [T, in]), from one layer pass.

    `keep`: only those samples' inputs are kept (the pass still runs every sample); `means`,
    when given, receives each input's mean |x| per channel over every sample
    (`activation_mean` of all of them) without keeping them: AWQ scores its searches on a few
    samples, and keeping every input of a 7B layer at 256 x 2,048 tokens took 31 GB, twice
    with the smoothed copies."""
    captured: dict[str, list[torch.Tensor]] = {a: [] for a in attrs}
    sums: dict[str, torch.Tensor] = {}  # sum of |x| per channel
    tokens = dict.fromkeys(attrs, 0)
    sample = [0]
    kept = None if keep is None else set(keep)

    def hook(_m, inp, a: str) -> None:
        x = inp[0].detach()
        if means is not None:
            flat = x.reshape(-1, x.shape[-1])
            part = flat.abs().sum(dim=0, dtype=torch.float32)
            sums[a] = sums[a] + part if a in sums else part
            tokens[a] += flat.shape[0]
        if kept is None or sample[0] in kept:
            captured[a].append(x)

    handles = [
        layer.get_submodule(a).register_forward_pre_hook(lambda m, inp, a=a: hook(m, inp, a))
        for a in attrs
    ]
    try:
        with torch.no_grad():
            for i, h in enumerate(hidden_states):
                sample[0] = i
                _run_layer(layer, [h], None if positions is None else [positions[i]])
    finally:
        for h in handles:
            h.remove()
    if means is not None:
        for a, total in sums.items():
            means[a] = total / max(tokens[a], 1)
    return captured


def _module_outputs(
    module: nn.Module, inputs: list[torch.Tensor], positions: Positions | None = None
) -> list[torch.Tensor]:
    """`module` on each sample; attention takes the sample's positions too."""
    if hasattr(module, "qkv_proj"):
        positions = positions or [None] * len(inputs)
        return [module(_positions(x, p), x, None) for x, p in zip(inputs, positions, strict=True)]
    # Token-wise modules: one large matmul beats one per sample on a CPU.
    return [module(torch.cat(inputs))]


def _output_mse(reference: list[torch.Tensor], outputs: list[torch.Tensor]) -> float:
    total = sum(
        float((o - r).float().pow(2).sum(dtype=torch.float64)) for o, r in zip(outputs, reference)
    )
    return total / max(sum(r.numel() for r in reference), 1)


def _shard_rows(model: nn.Module, layer: nn.Module, attr: str, shard: str) -> slice:
    """The output rows of HF module `shard` (e.g. v_proj) inside pagoda's fused `attr`."""
    module = layer.get_submodule(attr)
    leaf = attr.rpartition(".")[2]
    names = model.packed_modules_mapping.get(leaf, [leaf])
    i = names.index(shard)
    sizes = module.out_features_per_shard
    start = sum(sizes[:i])
    return slice(start, start + sizes[i])


def _search_linear_scales(
    linear: nn.Module,
    inspect: nn.Module,
    inputs: list[torch.Tensor],
    x_mean: torch.Tensor,
    args: WeightQuantArgs,
    options: PipelineOptions,
    positions: Positions | None = None,
) -> ScaleSearch:
    """`search_scales` for `linear` (`x_mean`: mean |x| per channel over every calibration
    token), scored by the output MSE of `inspect` (which contains it) on `inputs`; `linear`
    keeps its original weight afterwards."""
    original = linear.weight.data
    reference = _module_outputs(inspect, inputs, positions)

    def loss_of(candidate: torch.Tensor) -> float:
        linear.weight.data = candidate
        return _output_mse(reference, _module_outputs(inspect, inputs, positions))

    try:
        return search_scales(original, x_mean, args, loss_of, options.awq, options.scale_dtype)
    finally:
        linear.weight.data = original


def smooth_layer(
    model: nn.Module,
    layer: nn.Module,
    index: int,
    mappings: tuple[SmoothMapping, ...],
    captured: dict[str, list[torch.Tensor]],
    args: WeightQuantArgs,
    options: PipelineOptions,
    positions: Positions | None = None,
    means: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], list[SmoothReport]]:
    """AWQ's scale search for each mapping in turn, folded into the layer's weights at once
    (the next search sees them). `captured` holds the inputs of the quantized linears and is
    divided by the scales as they are applied (new lists: the caller's stay as they were).
    The searches score on the samples of `captured` (`positions`: theirs); the channel means
    are `means[attr]` (over every sample, also those `captured` does not hold) or
    `activation_mean` of `captured`. Returns the dense tensors the folding changed (norm
    weights, a shard's bias; HF module names) and one report per search."""
    _, decoder_name = decoder_of(model)
    prefix = f"{decoder_name}.layers.{index}"
    changed: dict[str, torch.Tensor] = {}
    reports = []
    for m in mappings:
        if m.linear not in captured:  # ignored (kept dense): nothing to protect
            continue
        linear = layer.get_submodule(m.linear)
        prev = layer.get_submodule(m.prev)
        rows = None
        if m.prev_shard is not None:
            if m.prev not in captured:  # a dense prev would have to be rewritten whole
                continue
            rows = _shard_rows(model, layer, m.prev, m.prev_shard)
            if rows.stop - rows.start != linear.in_features:  # e.g. v_proj -> o_proj with GQA
                continue
        inspect = layer.get_submodule(m.inspect)
        inputs = captured[m.linear]  # the inspected module reads the same input
        original = linear.weight.data
        with torch.no_grad():
            result = _search_linear_scales(
                linear,
                inspect,
                inputs,
                means[m.linear] if means is not None else activation_mean(inputs),
                args,
                options,
                positions,
            )
            s = result.scales.to(original.device)  # [in]
            linear.weight.data = (original.float() * s).to(original.dtype)
            if rows is None:  # RMSNorm: y = w * x / rms(x)
                prev.weight.data = (prev.weight.data.float() / s).to(prev.weight.dtype)
                changed[f"{prefix}.{m.prev}.weight"] = prev.weight.data.clone()
            else:
                w = prev.weight.data
                w[rows] = (w[rows].float() / s[:, None]).to(w.dtype)
                if getattr(prev, "bias", None) is not None:
                    b = prev.bias.data
                    b[rows] = (b[rows].float() / s).to(b.dtype)
                    parent = m.prev.rpartition(".")[0]
                    changed[f"{prefix}.{parent}.{m.prev_shard}.bias"] = b[rows].clone()
            captured[m.linear] = [(x.float() / s).to(x.dtype) for x in inputs]
        reports.append(
            SmoothReport(
                f"{prefix}.{m.prev}" + (f"[{m.prev_shard}]" if m.prev_shard else ""),
                f"{prefix}.{m.linear}",
                result.ratio,
                result.loss,
                result.initial_loss,
            )
        )
    return changed, reports


def clip_layer(
    layer: nn.Module,
    targets: list[TargetLinear],
    captured: dict[str, list[torch.Tensor]],
    args: WeightQuantArgs,
    options: PipelineOptions,
) -> dict[str, torch.Tensor]:
    """attr -> the weight [sum(out), in] each target is rounded from: AWQ's clip search per
    shard (q_proj / k_proj left as they are)."""
    clipped = {}
    for t in targets:
        module = layer.get_submodule(t.attr)
        w = module.weight.data.to(torch.float32).clone()
        x = torch.cat([c.reshape(-1, module.in_features) for c in captured[t.attr]])
        start = 0
        for name, size, quantized in zip(t.hf_names, module.out_features_per_shard, t.quantized):
            if quantized and not name.endswith(_AWQ_UNCLIPPED):
                part = w[start : start + size]
                max_val = search_clip(part, x, args, options.awq, options.scale_dtype)
                w[start : start + size] = apply_clip(part, max_val)
            start += size
        clipped[t.attr] = w
    return clipped


def _quantized_rows(layer: nn.Module, target: TargetLinear) -> torch.Tensor:  # [n] long
    """The output rows of `target`'s fused weight that are quantized (not --ignore'd)."""
    module = layer.get_submodule(target.attr)
    sizes = module.out_features_per_shard
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    device = module.weight.device
    return torch.cat(
        [
            torch.arange(o, o + n, device=device)
            for o, n, q in zip(offsets, sizes, target.quantized)
            if q
        ]
    )


def _awq_layer(
    model: nn.Module,
    layer: nn.Module,
    index: int,
    mappings: tuple[SmoothMapping, ...],
    targets: list[TargetLinear],
    hidden_states: list[torch.Tensor],
    args: WeightQuantArgs,
    options: PipelineOptions,
    layer_report: LayerReport,
    compressed: dict[str, torch.Tensor],
    positions: Positions | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]]]:
    """AWQ on one layer: scale searches, clip search, then the guard's pick among smoothed +
    clipped, smoothed, and plain rounding of the unsmoothed layer (by the layer's output error
    on the scored samples). Leaves the layer holding the picked (unrounded) weights, writes the
    dense tensors its smoothing changed into `compressed`, and returns (attr -> the weight to
    round, where clipped; attr -> the linears' inputs in the picked layer, on the scored
    samples `evaluation_samples` picks; the clip search sees those too)."""
    scored = evaluation_samples([h.shape[0] for h in hidden_states], options.awq.search_tokens)
    guard_inputs = [hidden_states[i] for i in scored]
    guard_positions = None if positions is None else [positions[i] for i in scored]

    def run(layer: nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return _run_layer(layer, inputs, guard_positions)

    rounded = [RoundedTarget(t.attr, _quantized_rows(layer, t)) for t in targets]
    original = {k: v.clone() for k, v in layer.state_dict().items()}
    with torch.no_grad():
        reference = run(layer, guard_inputs)  # the float layer

    def error(rounded_from: dict[str, torch.Tensor] | None = None) -> float:
        weights = rounded_weights(layer, rounded, args, options.scale_dtype, rounded_from)
        return layer_error(layer, weights, guard_inputs, reference, run)

    errors = {"rtn": error()}
    # The searches' samples only (their channel means from every sample)
    means: dict[str, torch.Tensor] = {}
    captured = _capture_inputs(
        layer, [t.attr for t in targets], hidden_states, positions, keep=scored, means=means
    )
    unsmoothed = dict(captured)  # smooth_layer replaces the lists it rescales
    changed, layer_report.smoothing = smooth_layer(
        model, layer, index, mappings, captured, args, options, guard_positions, means
    )
    errors["scales"] = error()
    clipped: dict[str, torch.Tensor] = {}
    if options.awq.clip:
        clipped = clip_layer(layer, targets, captured, args, options)
        errors["scales+clip"] = error(clipped)
    choice = choose(errors)
    layer_report.awq_choice, layer_report.awq_errors = choice.name, choice.errors
    if choice.name == "rtn":
        layer.load_state_dict(original)
        return {}, unsmoothed
    for name, tensor in changed.items():
        compressed[name] = tensor.to(options.storage_dtype).cpu()
    return (clipped if choice.name == "scales+clip" else {}), captured


def _layer_hessians(
    layer: nn.Module,
    attrs: list[str],
    hidden_states: list[torch.Tensor],
    positions: Positions | None = None,
    token_weights: dict[str, list[torch.Tensor]] | None = None,
) -> dict[str, HessianAccumulator]:
    """One pass of every sample through `layer`: the Hessian of each linear `attrs`' input;
    `token_weights[attr]`: per sample, each token's weight in that linear's Hessian."""
    hessians: dict[str, HessianAccumulator] = {}
    handles = []
    sample = [0]  # index of the sample in the pass

    def hook(module: nn.Module, inp: tuple[torch.Tensor, ...], attr: str) -> None:
        weights = (token_weights or {}).get(attr)
        hessians[attr].add(inp[0], None if weights is None else weights[sample[0]])

    for attr in attrs:
        module = layer.get_submodule(attr)
        hessians[attr] = HessianAccumulator(module.in_features, module.weight.device)
        handles.append(
            module.register_forward_pre_hook(lambda m, inp, attr=attr: hook(m, inp, attr))
        )
    positions = positions or [None] * len(hidden_states)
    try:
        with torch.no_grad():
            for i, (hidden, pos) in enumerate(zip(hidden_states, positions, strict=True)):
                sample[0] = i
                _run_layer(layer, [hidden], [pos])
    finally:
        for h in handles:
            h.remove()
    return hessians


def final_norm_outputs(
    model: nn.Module,
    source: WeightSource,
    hidden_states: list[torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """The decoder's final norm over the last layer's outputs: what lm_head reads, per sample."""
    decoder, prefix = decoder_of(model)
    with torch.device(device):
        norm = RMSNorm(decoder.norm.hidden_size, eps=decoder.norm.eps, dtype=dtype)
    norm.weight.data.copy_(source.get(f"{prefix}.norm.weight").to(device=device, dtype=dtype))
    with torch.no_grad():
        return [norm(h) for h in hidden_states]


def _quantize_lm_head(
    model: nn.Module,
    source: WeightSource,
    hidden_states: list[torch.Tensor],
    args: WeightQuantArgs,
    options: PipelineOptions,
    report: QuantizeReport,
) -> dict[str, torch.Tensor]:
    """lm_head quantized on the final-norm outputs of the quantized decoder (its Hessian)."""
    start = time.perf_counter()
    device = options.device
    weight = source.get("lm_head.weight").to(device=device, dtype=torch.float32)
    hidden = weight.shape[1]
    if hidden_states:
        acc = HessianAccumulator(hidden, device)
        for x in final_norm_outputs(model, source, hidden_states, device, options.compute_dtype):
            acc.add(x)
        hessian = acc.hessian
    else:  # RTN without calibration data: the report's error is the plain weight error
        hessian = None
    qw, deq, loss, _ = _quantize_matrix(weight, hessian, args, options, report, "lm_head")
    err = hessian_weighted_error(weight, deq, hessian)
    denom = hessian_weighted_error(weight, torch.zeros_like(weight), hessian)
    compressed = {
        f"lm_head.{key}": tensor.cpu()
        for key, tensor in compress(qw, args, options.storage_dtype).items()
    }
    report.lm_head = ModuleReport(
        "lm_head",
        (weight.shape[0], hidden),
        err / max(denom, 1e-30),
        loss,
        time.perf_counter() - start,
    )
    return compressed


def quantize_layers(
    model: nn.Module,
    source: WeightSource,
    samples: list[torch.Tensor],
    args: WeightQuantArgs | Fp8Args,
    ignore: list[str],
    options: PipelineOptions,
    report: QuantizeReport,
    on_layer: Callable[[int], None] | None = None,
    lm_head: bool = False,
    kv_cache_scales: bool = False,
    mm_inputs: list[MultiModalInputs | None] | None = None,
    image_config: ImageProcessorConfig | None = None,
    token_weights: dict[str, list[torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Quantize every decoder layer of `model` (built on meta); returns the tensors that
    replace the checkpoint's: each quantized module's (`{module}.weight_packed`, ... or
    `{module}.qweight`, ...) and, for AWQ, the dense ones its smoothing changed (norm weights).

    `lm_head`: quantize the LM head too, after the last layer (see `_quantize_lm_head`).
    FP8 args (`pagoda.quantizer.fp8`): min-max e4m3 codes, static input scales from the
    calibration pass; `kv_cache_scales`: each layer's `self_attn.k_scale` / `v_scale` too.
    `mm_inputs` (vision-language models, one per sample or empty): the samples' images and
    videos go through the vision tower (`vision_rows`; `image_config` prepares their pixels).
    Tensor names are module names; `WeightSource.checkpoint_name` turns them into the
    checkpoint's layout. `token_weights` (GPTQ, `pagoda.quantizer.guided`): by HF module name,
    per sample, each token's ||dL/dy||² in that module's output; the Hessians weight the
    tokens by it.
    """
    from tqdm import tqdm

    device, dtype = options.device, options.compute_dtype
    awq = options.method == "awq"
    mappings: tuple[SmoothMapping, ...] = ()
    if awq:
        mappings = AWQ_MAPPINGS.get(type(model).__name__, ())
        if not mappings:
            raise ValueError(f"AWQ has no smoothing mappings for {type(model).__name__}")
    if awq and not samples:
        raise ValueError("AWQ needs calibration data: pass dataset (a .json, .jsonl or .txt file)")
    rope = calibration_rope(model, device)
    # Inputs of layer 0, captured once: the embeddings of every sample (image rows from the
    # vision tower), each [T, hidden].
    state = CalibrationState.start(
        model, source, samples, mm_inputs or [], image_config, device, dtype
    )
    hidden_states, positions = state.hidden_states, state.positions
    compressed: dict[str, torch.Tensor] = {}
    decoder, decoder_name = decoder_of(model)
    layers = decoder.layers
    bar = tqdm(range(len(layers)), desc=f"{options.method} layers", disable=not options.progress)
    for index in bar:
        start = time.perf_counter()
        layer = layers[index]
        _load_layer(model, layer, index, source, device, dtype)
        layer.self_attn.rotary_emb = rope  # after to_empty, which would wipe its tables
        targets = [t for t in layer_targets(model, index, ignore) if any(t.quantized)]
        layer_report = LayerReport(index, 0.0)

        hessians: dict[str, HessianAccumulator] = {}
        fp8 = isinstance(args, Fp8Args)
        layer_weights = None
        if token_weights is not None:
            layer_weights = {
                t.attr: fused_token_weights(token_weights, t.hf_names) for t in targets
            }
        inputs_amax, kv_amax = AmaxObserver(), KVScaleObserver()
        if fp8 and args.static_input:
            for t in targets:
                inputs_amax.watch(layer.get_submodule(t.attr), t.attr)
        if kv_cache_scales:
            kv_amax.watch(layer.self_attn.attn, "kv")
        rounded_from: dict[str, torch.Tensor] = {}  # AWQ: the clipped weights to round
        if awq:
            rounded_from, inputs = _awq_layer(
                model, layer, index, mappings, targets, hidden_states, args, options,
                layer_report, compressed, positions,
            )  # fmt: skip
            # Hessians of the rounded layer's inputs, for the report only: on the samples the
            # searches scored (`inputs` holds those only; X^T X in float32 on every token was
            # an eighth of AWQ's time)
            for t in targets:
                acc = HessianAccumulator(layer.get_submodule(t.attr).in_features, device)
                for x in inputs.pop(t.attr):
                    acc.add(x)
                hessians[t.attr] = acc
        # RTN needs no Hessian itself, but the report's error is Hessian-weighted; without
        # calibration samples (RTN only) H = I and the error is the plain weight error.
        elif samples:
            hessians = _layer_hessians(
                layer, [t.attr for t in targets], hidden_states, positions, layer_weights
            )
        inputs_amax.remove()
        kv_amax.remove()
        reference = None
        if options.refine_steps and samples and not fp8 and not awq:
            with torch.no_grad():  # the float layer's outputs, before any weight is rounded
                reference = _run_layer(layer, hidden_states, positions)
        if kv_cache_scales:
            attn_name = f"{decoder_name}.layers.{index}.self_attn"
            for key, tensor in kv_amax.scales("kv", options.storage_dtype).items():
                compressed[f"{attn_name}.{key}"] = tensor.cpu()

        rounded = []  # (target, rows, float rows, H, quantized, dequantized, loss, seconds)
        unrounded_of: dict[str, torch.Tensor] = {}
        for t in targets:
            module = layer.get_submodule(t.attr)
            t0 = time.perf_counter()
            weight = module.weight.data  # [sum(out), in]
            hessian = hessians[t.attr].hessian if t.attr in hessians else None  # None: H = I
            sizes = module.out_features_per_shard
            rows = _quantized_rows(layer, t)
            w = weight[rows].to(torch.float32)
            if fp8:
                kept = [size for size, q in zip(sizes, t.quantized) if q]
                parts, deq = quantize_fp8_shards(w, kept, args, options.storage_dtype)
                weight[rows] = deq.to(weight.dtype)  # the quantized layer feeds the next one
                seconds = time.perf_counter() - t0
                names = [n for n, q in zip(t.hf_names, t.quantized) if q]
                row = 0
                for name, size, (q, scale) in zip(names, kept, parts):
                    amax = inputs_amax.amax.get(t.attr) if args.static_input else None
                    if args.static_input and amax is None:
                        raise ValueError("FP8 static activation scales need calibration data")
                    for key, tensor in fp8_tensors(q, scale, amax, options.storage_dtype).items():
                        compressed[f"{name}.{key}"] = tensor.cpu()
                    ref, got = w[row : row + size], deq[row : row + size]
                    denom = hessian_weighted_error(ref, torch.zeros_like(ref), hessian)
                    err = hessian_weighted_error(ref, got, hessian)
                    layer_report.modules.append(
                        ModuleReport(
                            name, (size, w.shape[1]), err / max(denom, 1e-30), None, seconds
                        )
                    )
                    row += size
                continue
            source_w = rounded_from[t.attr][rows] if t.attr in rounded_from else w
            # Rows are independent given H: q/k/v (or gate/up) are quantized in one call and
            # stored as the separate HF modules the checkpoint format expects.
            qw, deq, loss, unrounded = _quantize_matrix(
                source_w, hessian, args, options, report, f"{decoder_name}.layers.{index}.{t.attr}"
            )
            weight[rows] = deq.to(weight.dtype)  # the quantized layer feeds the next one
            rounded.append((t, rows, w, hessian, qw, deq, loss, time.perf_counter() - t0))
            unrounded_of[t.attr] = unrounded
        if reference is not None and rounded:
            t0 = time.perf_counter()
            refined, refine_report = refine_layer(
                layer,
                [
                    RefineTarget(t.attr, rows, qw, unrounded_of[t.attr])
                    for t, rows, _, _, qw, _, _, _ in rounded
                ],
                hidden_states,
                [
                    _positions(x, p)
                    for x, p in zip(hidden_states, positions or [None] * len(hidden_states))
                ],
                reference,
                args,
                options.refine_steps,
                seed=index,
            )
            layer_report.refine = refine_report
            share = (time.perf_counter() - t0) / len(rounded)
            for i, (t, rows, w, hessian, qw, deq, loss, seconds) in enumerate(rounded):
                qw = refined[t.attr]
                deq = qw.dequantize(torch.float32)
                weight = layer.get_submodule(t.attr).weight.data
                weight[rows] = deq.to(weight.dtype)
                rounded[i] = (t, rows, w, hessian, qw, deq, loss, seconds + share)
            del reference
        del unrounded_of
        for t, _, w, hessian, qw, deq, loss, seconds in rounded:
            module = layer.get_submodule(t.attr)
            sizes = module.out_features_per_shard
            row = 0
            for name, size, q in zip(t.hf_names, sizes, t.quantized):
                if not q:
                    continue
                part = QuantizedWeight(
                    qw.qweight[row : row + size],
                    qw.scale[row : row + size],
                    None if qw.zero_point is None else qw.zero_point[row : row + size],
                    qw.group_size,
                )
                denom = hessian_weighted_error(
                    w[row : row + size], torch.zeros_like(w[row : row + size]), hessian
                )
                err = hessian_weighted_error(w[row : row + size], deq[row : row + size], hessian)
                for key, tensor in pack_module(part, args, options).items():
                    compressed[f"{name}.{key}"] = tensor.cpu()
                layer_report.modules.append(
                    ModuleReport(
                        name,
                        (size, w.shape[1]),
                        err / max(denom, 1e-30),
                        None if loss is None else loss * size / w.shape[0],
                        seconds * size / w.shape[0],
                    )
                )
                row += size
        del hessians
        if samples:
            state.hidden_states = hidden_states
            state.advance(layer, index)
            hidden_states = state.hidden_states
        layer.self_attn.rotary_emb = None  # shared: must not follow the layer to meta
        layer.to("meta")  # offload: only one layer is ever materialised
        if device.type == "cuda":
            torch.cuda.empty_cache()
        layer_report.seconds = time.perf_counter() - start
        report.layers.append(layer_report)
        worst = max((m.relative_error for m in layer_report.modules), default=0.0)
        bar.set_postfix(layer=index, err=f"{worst:.3g}")
        if on_layer is not None:
            on_layer(index)
    if lm_head:
        compressed.update(_quantize_lm_head(model, source, hidden_states, args, options, report))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    errors = [m.relative_error for lr in report.layers for m in lr.modules]
    if report.lm_head is not None:
        errors.append(report.lm_head.relative_error)
    if not math.isfinite(sum(errors)):
        raise ValueError("quantization produced non-finite errors; check the model's weights")
    return compressed
