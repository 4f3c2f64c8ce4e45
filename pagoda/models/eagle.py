"""The EAGLE draft head (EAGLE-1/2): decoder layer(s) that extrapolate the target's features.

Entry i of the head reads the target's embedding of token i+1 and the target's feature f_i,
fuses them (`fc`: [2H] -> [H]) and runs one Llama/Qwen2 decoder layer (usually one) at
position i. Its output f̂_{i+1} guesses the target's next feature; the target's own lm_head
turns it into a guess of token i+2, and in a chain of drafts f̂ stands in for the feature of
the next entry. The embedding and lm_head are the target's, shared, never stored in the head.

The feature is what the target's lm_head reads (the last layer's output after the final norm),
as in EAGLE's reference code and vLLM's `EagleLlamaForCausalLM`, so published EAGLE-1 heads
load: their f̂ goes to lm_head unchanged. The first layer has no input norm (its input is
`fc`'s output, EAGLE's choice) unless the checkpoint carries `layers.0.input_layernorm.weight`.
Checkpoints: a directory with config.json (the layer's config: hidden_size, heads, kv heads,
intermediate_size, rope, the target's vocab_size) and safetensors (or EAGLE-1's
pytorch_model.bin) with `fc.weight`, optional `fc.bias`, `layers.N.*` in HF decoder-layer names;
a stored `embed_tokens.weight` (EAGLE-1 ships the target's) is ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagoda.layers.attention import Attention, AttentionMetadata
from pagoda.layers.linear import ReplicatedLinear, default_linear_method_factory
from pagoda.layers.rotary import get_rope
from pagoda.models.llama import DecoderLayer, DecoderOptions, LlamaForCausalLM, load_hf_weights
from pagoda.models.registry import architectures_of, get_model_class

if TYPE_CHECKING:
    from pagoda.config import ModelConfig

# Stored by EAGLE-1 checkpoints but shared with the target here.
_SHARED_WITH_TARGET = ("embed_tokens.weight",)


def head_decoder_options(config: Any, sliding_window: int | None) -> DecoderOptions:
    """The decoder layer's options as the target family's model class defines them (Qwen2 q/k/v
    bias, Qwen3 q/k norm, Llama's `attention_bias` / `mlp_bias`), found from the head config's
    `architectures`, else its `model_type`, else Llama's. `sliding_window`: the target's, whose
    blocks the head's cache shares (it must not look further back than the target keeps)."""
    by_type = architectures_of(SimpleNamespace(model_type=getattr(config, "model_type", None)))
    cls = get_model_class([*architectures_of(config), *by_type, "LlamaForCausalLM"])
    if not hasattr(cls, "decoder_options"):
        raise ValueError(
            f"EAGLE head config: architecture {cls.__name__} has no text decoder layer to draft"
        )
    return dataclasses.replace(cls.decoder_options(config), sliding_window=sliding_window)


class EagleHead(nn.Module):
    """fc(concat(embed(token_{i+1}), f_i)) -> decoder layer(s) -> f̂_{i+1} (no final norm)."""

    _stacked_params = LlamaForCausalLM._stacked_params
    _param_name_and_shard = LlamaForCausalLM._param_name_and_shard
    tie_word_embeddings = False
    lm_head = None  # the target's

    def __init__(
        self,
        config: Any,
        fc_bias: bool = False,
        first_input_norm: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.options = head_decoder_options(config, sliding_window)
        hidden = config.hidden_size
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=fc_bias, prefix="fc")
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.rotary_emb = get_rope(config, head_dim)
        self.layers = nn.ModuleList(
            DecoderLayer(
                config, self.options, self.rotary_emb, default_linear_method_factory, f"layers.{i}"
            )
            for i in range(config.num_hidden_layers)
        )
        if not first_input_norm:
            # fc's output goes into attention unnormalized (EAGLE); later layers keep theirs.
            self.layers[0].input_layernorm = nn.Identity()
        self.first_input_norm = first_input_norm

    def forward(
        self,
        input_embeds: torch.Tensor,  # [T, H]: the target's embedding of token i+1
        features: torch.Tensor,  # [T, H]: the target's feature at i (or the head's guess)
        positions: torch.Tensor,  # [T]: i
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:  # [T, H]: f̂_{i+1}
        hidden = self.fc(torch.cat((input_embeds, features.to(input_embeds.dtype)), dim=-1))
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
        return hidden + residual

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> shape, in HF decoder-layer names (the names a head may carry)."""
        cfg, opt = self.config, self.options
        h, inter = cfg.hidden_size, cfg.intermediate_size
        attn = self.layers[0].self_attn
        q, kv, d = attn.q_size, attn.kv_size, attn.head_dim
        shapes: dict[str, tuple[int, ...]] = {"fc.weight": (h, 2 * h)}
        if self.fc.bias is not None:
            shapes["fc.bias"] = (h,)
        for i in range(len(self.layers)):
            p = f"layers.{i}."
            shapes |= {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "post_attention_layernorm.weight": (h,),
            }
            if i > 0 or self.first_input_norm:
                shapes[p + "input_layernorm.weight"] = (h,)
            if opt.qkv_bias:
                shapes |= {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            if opt.o_proj_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if opt.mlp_bias:
                shapes |= {
                    p + "mlp.gate_proj.bias": (inter,),
                    p + "mlp.up_proj.bias": (inter,),
                    p + "mlp.down_proj.bias": (h,),
                }
            if opt.qk_norm:
                shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        return shapes

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], where: str = "") -> None:
        """Load EAGLE-layout tensors (already named as `checkpoint_names` gives them). Every
        unknown name, wrong shape or missing tensor is one ValueError naming them all."""
        expected = self.expected_shapes()
        tensors = dict(weights)
        problems = []
        unknown = sorted(set(tensors) - set(expected))
        if unknown:
            problems.append(f"unknown tensors {', '.join(unknown[:12])}")
        wrong = [
            f"{n} {tuple(t.shape)} (expected {expected[n]})"
            for n, t in tensors.items()
            if n in expected and tuple(t.shape) != expected[n]
        ]
        if wrong:
            problems.append(f"shapes that do not fit its config.json: {', '.join(wrong[:12])}")
        missing = sorted(set(expected) - set(tensors))
        if missing:
            problems.append(f"missing tensors {', '.join(missing[:12])}")
        if problems:
            raise ValueError(f"EAGLE head {where}: {'; '.join(problems)}")
        load_hf_weights(self, tensors.items())


def checkpoint_names(name: str) -> str:
    """A stored name in the head's own names: speculators / vLLM-style `model.` prefixes off."""
    return name.removeprefix("model.")


def read_head_tensors(head_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a head directory (safetensors, else EAGLE-1's pytorch_model.bin), on
    the CPU, named as the head names them; the target's shared embedding dropped."""
    from pagoda.models.loader import iter_safetensors_weights

    path = Path(head_dir)
    if not any(path.glob("*.safetensors")) and (path / "pytorch_model.bin").is_file():
        try:
            items = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # a pickle that is not a plain tensor dict
            raise ValueError(f"{path / 'pytorch_model.bin'}: cannot read ({e})") from None
        items = items.items()
    else:
        items = iter_safetensors_weights(path)
    tensors = {}
    for name, tensor in items:
        name = checkpoint_names(name)
        if name not in _SHARED_WITH_TARGET:
            tensors[name] = tensor
    return tensors


def load_eagle_head(
    model_config: ModelConfig, device: torch.device, sliding_window: int | None
) -> EagleHead:
    """Build the head of `model_config` (a head directory, or `config:` for random weights) in
    its dtype on `device` and load its tensors; the checkpoint decides whether `fc` has a bias
    and whether the first layer keeps its input norm."""
    from pagoda.models.loader import _default_dtype, _init_dummy_weights

    dummy = model_config.load_format == "dummy"
    tensors = {} if dummy else read_head_tensors(model_config.model)
    dtype = getattr(torch, model_config.dtype)
    with _default_dtype(dtype), device:
        head = EagleHead(
            model_config.hf_config,
            fc_bias="fc.bias" in tensors,
            first_input_norm="layers.0.input_layernorm.weight" in tensors,
            sliding_window=sliding_window,
        )
    if dummy:
        _init_dummy_weights(head, model_config.seed, device)
    else:
        head.load_weights(
            ((n, t.to(device)) for n, t in tensors.items()), where=repr(model_config.model)
        )
    return head.eval()
