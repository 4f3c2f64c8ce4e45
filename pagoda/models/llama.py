"""Llama-family decoder (Llama 3 / 3.1, SmolLM2) and the shared skeleton of Qwen2 / Qwen3.

One implementation with `DecoderOptions` (qkv / o_proj / MLP bias, per-head q/k RMSNorm)
covers all three architectures; `Qwen2ForCausalLM` and `Qwen3ForCausalLM` only pick options.
Module names mirror Hugging Face so checkpoints load by name; q/k/v and gate/up are fused into
`qkv_proj` / `gate_up_proj` and `load_weights` routes each HF tensor to its shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda.layers.activation import SiluAndMul
from pagoda.layers.attention import Attention, AttentionMetadata
from pagoda.layers.embedding import LMHead, VocabEmbedding
from pagoda.layers.linear import (
    LinearMethodFactory,
    MergedColumnLinear,
    QKVLinear,
    ReplicatedLinear,
    default_linear_method_factory,
)
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding, get_rope

# Checkpoint tensors that are derived state, never parameters.
_SKIPPED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass(frozen=True)
class DecoderOptions:
    """Where the supported architectures differ."""

    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # Mistral: every layer attends to the last W keys only


def _text_config(hf_config: Any) -> Any:
    # Vision-language configs nest the decoder's config.
    return getattr(hf_config, "text_config", None) or hf_config


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    """qkv_proj -> (q/k norm) -> RoPE -> paged attention -> o_proj."""

    def __init__(
        self,
        config: Any,
        options: DecoderOptions,
        rotary_emb: RotaryEmbedding,
        linear_method_factory: LinearMethodFactory,
        prefix: str,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVLinear(
            config.hidden_size,
            self.head_dim,
            self.num_heads,
            self.num_kv_heads,
            bias=options.qkv_bias,
            linear_method=linear_method_factory(f"{prefix}.qkv_proj"),
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = ReplicatedLinear(
            self.q_size,
            config.hidden_size,
            bias=options.o_proj_bias,
            linear_method=linear_method_factory(f"{prefix}.o_proj"),
            prefix=f"{prefix}.o_proj",
        )
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb  # shared by all layers: one cos/sin table per model
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            sliding_window=options.sliding_window,
        )

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, hidden]
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            num_tokens = hidden.shape[0]
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = q.view(num_tokens, self.q_size), k.view(num_tokens, self.kv_size)
        if self.attn.use_fused_decode(positions, q, self.rotary_emb, attn_metadata):
            # Decode-only CUDA step: RoPE, cache write and attention in one kernel that reads
            # q (normed for Qwen3), k and v in place, strided views of the QKV output included.
            out = self.attn.forward_fused_decode(positions, q, k, v, self.rotary_emb, attn_metadata)
        else:
            q, k = self.rotary_emb(positions, q, k)
            out = self.attn(q, k, v.contiguous(), attn_metadata)  # [T, H*D]
        return self.o_proj(out)


class DecoderMLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)) with gate/up fused."""

    def __init__(
        self,
        config: Any,
        options: DecoderOptions,
        linear_method_factory: LinearMethodFactory,
        prefix: str,
    ) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act={config.hidden_act!r}; only 'silu' is supported")
        self.gate_up_proj = MergedColumnLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            bias=options.mlp_bias,
            linear_method=linear_method_factory(f"{prefix}.gate_up_proj"),
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = ReplicatedLinear(
            config.intermediate_size,
            config.hidden_size,
            bias=options.mlp_bias,
            linear_method=linear_method_factory(f"{prefix}.down_proj"),
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


# Positions the key center averages RoPE(k bias) over (at most max_model_len). Measured on
# Qwen2.5-Coder-0.5B (e4m3, 512-token windows; BENCHMARKS.md "FP8"): 512 and 4,096 positions
# +0.5 % perplexity, 32,768 (Qwen2.5's max_model_len) +0.97 %: over that many positions the
# mid-frequency channels average to zero and lose their centering.
KEY_CENTER_POSITIONS = 4096


def bind_key_centers(model: nn.Module, max_model_len: int) -> int:
    """Set each layer's `Attention.k_center` (used with an FP8 cache) where its keys carry a
    bias: the mean over positions 0 .. min(max_model_len, KEY_CENTER_POSITIONS) - 1 of
    RoPE(k bias), rounded to the model dtype. Qwen2's k bias puts large, nearly constant values
    in its slowly rotating channels; stored minus that constant, e4m3 rounds only what varies
    between keys (attention.py's docstring). Layers with a k-norm (Qwen3) or no bias keep None.
    Returns the layers set."""
    num_positions = min(max_model_len, KEY_CENTER_POSITIONS)
    bound = 0
    for module in model.modules():
        if not isinstance(module, DecoderAttention):
            continue
        attn = module.attn
        bias = module.qkv_proj.bias
        if bias is None or module.k_norm is not None:
            attn.k_center = None
            continue
        d = attn.head_dim
        if bias.numel() != (attn.num_heads + 2 * attn.num_kv_heads) * d:
            attn.k_center = None  # not this layer's q / k / v heads (a sharded layout)
            continue
        k_bias = bias.detach()[attn.num_heads * d : (attn.num_heads + attn.num_kv_heads) * d]
        positions = min(num_positions, module.rotary_emb.cos_cache.shape[0])
        center = module.rotary_emb.mean_rotated(k_bias.view(attn.num_kv_heads, d), positions)
        attn.k_center = center.to(bias.dtype).float().contiguous()
        bound += 1
    return bound


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the following RMSNorm."""

    def __init__(
        self,
        config: Any,
        options: DecoderOptions,
        rotary_emb: RotaryEmbedding,
        linear_method_factory: LinearMethodFactory,
        prefix: str,
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(
            config, options, rotary_emb, linear_method_factory, f"{prefix}.self_attn"
        )
        self.mlp = DecoderMLP(config, options, linear_method_factory, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,  # [T, hidden]; None before the first layer
        attn_metadata: AttentionMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """embed_tokens -> layers -> norm (HF's `model.` submodule)."""

    def __init__(
        self,
        config: Any,
        options: DecoderOptions,
        linear_method_factory: LinearMethodFactory,
        prefix: str = "model",
    ) -> None:
        super().__init__()
        layer_types = getattr(config, "layer_types", None) or ()
        if "sliding_attention" in layer_types:
            # One window for all layers is supported (Mistral, `DecoderOptions.sliding_window`);
            # a per-layer mix of full and sliding layers is not.
            raise NotImplementedError(
                "per-layer sliding-window attention (layer_types) is not supported"
            )
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # Registered here (as HF does) and referenced from every layer's self_attn.
        self.rotary_emb = get_rope(config, _head_dim(config))
        self.layers = nn.ModuleList(
            DecoderLayer(
                config, options, self.rotary_emb, linear_method_factory, f"{prefix}.layers.{i}"
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [T]
        positions: torch.Tensor,  # [T]
        attn_metadata: AttentionMetadata | None,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden], replaces input_ids
    ) -> torch.Tensor:  # [T, hidden]
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Causal LM: `forward` returns hidden states, `compute_logits` the float32 logits."""

    # HF projection names fused into each of our layers, in shard order.
    packed_modules_mapping: dict[str, list[str]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    # (our param fragment, HF fragment, shard id) used by load_weights.
    _stacked_params: tuple[tuple[str, str, int | str], ...] = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    )

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=attention_bias,
            o_proj_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )

    def __init__(
        self, hf_config: Any, linear_method_factory: LinearMethodFactory | None = None
    ) -> None:
        super().__init__()
        config = _text_config(hf_config)
        self.config = config
        factory = linear_method_factory or default_linear_method_factory
        self.model = DecoderModel(config, self.decoder_options(config), factory)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = build_lm_head(
            config, factory, self.model.embed_tokens, self.tie_word_embeddings
        )

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn_metadata: AttentionMetadata | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        return self.model(input_ids, positions, attn_metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V] f32
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        """Every Attention module in layer order (the runner binds `kv_cache` to each)."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def _param_name_and_shard(self, hf_name: str) -> tuple[str, int | str | None]:
        """Our parameter name for an HF tensor name, and its shard when it lands in a fused one."""
        for ours, theirs, shard in self._stacked_params:
            if theirs in hf_name:
                return hf_name.replace(theirs, ours), shard
        return hf_name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns our parameter names that were fully loaded.

        Raises ValueError for tensors matching no parameter and for parameters left unloaded.
        """
        return load_hf_weights(self, weights)


def build_lm_head(
    config: Any,
    linear_method_factory: LinearMethodFactory,
    embed_tokens: VocabEmbedding,
    tie_word_embeddings: bool,
    prefix: str = "lm_head",
) -> LMHead:
    """The LM head: tied to `embed_tokens`, else quantized when the checkpoint's config covers
    lm_head (the factory says so: `lm_head_quantized`), else dense."""
    from pagoda.layers.quantized_linear import lm_head_quantized

    if tie_word_embeddings:
        return LMHead(config.vocab_size, config.hidden_size, tie_to=embed_tokens)
    method = linear_method_factory(prefix) if lm_head_quantized(linear_method_factory) else None
    return LMHead(config.vocab_size, config.hidden_size, linear_method=method, prefix=prefix)


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    skipped_suffixes: tuple[str, ...] = (),
    rename: Callable[[str], str] | None = None,
) -> set[str]:
    """The loading loop shared by the text and vision-language models.

    `model` provides `_stacked_params`, `_param_name_and_shard` and `tie_word_embeddings`;
    `rename` maps a checkpoint name to a module name (other checkpoint layouts), and tensors
    ending in `skipped_suffixes` are ignored on top of the usual ones.
    """
    params = dict(model.named_parameters())
    stacked = model._stacked_params
    shards_needed = {
        name: {shard for ours, _, shard in stacked if ours in f".{name}"} for name in params
    }
    skipped = _SKIPPED_WEIGHT_SUFFIXES + tuple(skipped_suffixes)
    shards_loaded: dict[str, set[int | str]] = {}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for hf_name, tensor in weights:
        if hf_name.endswith(skipped):
            continue
        name = rename(hf_name) if rename is not None else hf_name
        if model.tie_word_embeddings and name.startswith("lm_head."):
            continue  # same tensor as the embedding
        if name.endswith((".k_scale", ".v_scale")):
            _set_kv_scale(model, name, tensor)  # FP8 KV cache scales (kv_cache_scheme)
            continue
        param_name, shard = model._param_name_and_shard(name)
        param = params.get(param_name)
        if param is None:
            unexpected.append(hf_name)
            continue
        loader = getattr(param, "weight_loader", _default_weight_loader)
        if shard is None:
            loader(param, tensor)
            loaded.add(param_name)
        else:
            loader(param, tensor, shard)
            shards_loaded.setdefault(param_name, set()).add(shard)
            if shards_loaded[param_name] == shards_needed[param_name]:
                loaded.add(param_name)
    if unexpected:
        hint = ""
        if getattr(model.lm_head, "quantized", False) and any(
            (rename(n) if rename is not None else n) == "lm_head.weight" for n in unexpected
        ):
            hint = (
                "; the checkpoint stores lm_head dense while its quantization_config does not "
                'ignore lm_head: add "lm_head" to quantization_config.ignore'
            )
        raise ValueError(
            f"checkpoint tensors match no parameter of {type(model).__name__}: "
            f"{_name_list(unexpected)}{hint}"
        )
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(
            f"checkpoint is missing weights for {type(model).__name__}: {_name_list(missing)}"
        )
    return loaded


def _set_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """`...self_attn.k_scale` / `v_scale` [1] onto that layer's `Attention` (`self_attn.attn`)."""
    prefix, _, which = name.rpartition(".")
    try:
        attn = model.get_submodule(f"{prefix}.attn")
    except AttributeError:
        raise ValueError(f"checkpoint tensor {name} matches no attention layer") from None
    if tensor.numel() != 1:
        raise ValueError(f"{name}: per-tensor KV scales are supported, got {tuple(tensor.shape)}")
    value = float(tensor.float().item())
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")
    setattr(attn, which, value)
    attn.kv_scales_loaded = True


def _default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit parameter of "
            f"shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


def _name_list(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" ... ({len(names)} in all)" if len(names) > limit else "")
