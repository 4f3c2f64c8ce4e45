"""How one tensor-parallel rank builds and loads its part of a decoder.

The rank's model is built from a config with its share of the heads, the MLP width and the
vocabulary (`rank_model_config`), so every layer is created at its local shape. `ModelSharder`
then, before the weights load, wraps each parameter's loader to cut the rank's slice out of the
full checkpoint tensor, and inserts the collectives: an all-reduce after the row-parallel
o_proj / down_proj, a masked lookup + all-reduce in the vocabulary-parallel embedding, and an
all-gather of the vocabulary-parallel LM head's logits. The slice is found by comparing the full
tensor with the local parameter, so quantized formats (packed codes, group scales and zero
points along either axis) shard by the same rule as dense weights.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import ModelConfig
from pagoda.distributed.group import TensorParallelGroup
from pagoda.layers.embedding import LMHead, VocabEmbedding
from pagoda.layers.linear import LinearBase
from pagoda.model_files import transformers_config

# Decoder projections whose input is split across ranks (their partial outputs are summed).
_ROW_PARALLEL = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)$")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tensor_parallel_size(hf_config: Any, world_size: int) -> None:
    """ValueError naming the first model dimension `world_size` ranks cannot split.

    Query heads and the MLP width must divide evenly; KV heads either divide evenly or, when a
    model has fewer KV heads than ranks, each KV head is replicated on `world_size / Hkv`
    ranks (which must be a whole number). The vocabulary is padded, so it never limits. A
    vision tower (Qwen2.5-VL) is not split: its config is left as it is.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {world_size!r}")
    cfg = getattr(hf_config, "text_config", None) or hf_config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    width = cfg.intermediate_size
    if heads % world_size:
        ok = [
            d
            for d in _divisors(heads)
            if (kv_heads % d == 0 or d % kv_heads == 0) and width % d == 0
        ]
        raise ValueError(
            f"tensor_parallel_size={world_size} does not divide the model's {heads} attention "
            f"heads; sizes this model supports: {', '.join(map(str, ok))}"
        )
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={world_size} cannot split or replicate the model's "
            f"{kv_heads} KV heads (it must divide them, or be a multiple of them)"
        )
    if width % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} does not divide the MLP width {width}")


def rank_model_config(model_config: ModelConfig, world_size: int) -> ModelConfig:
    """`model_config` with the per-rank shapes: H / N query heads, max(1, Hkv / N) KV heads,
    I / N MLP width, ceil(V / N) vocabulary rows; head_dim and hidden size unchanged."""
    check_tensor_parallel_size(model_config.hf_config, world_size)
    if world_size == 1:
        return model_config
    # A cached GGUF config is a read-only view: shard a copy of the transformers config.
    hf_config = copy.deepcopy(transformers_config(model_config.hf_config))
    cfg = getattr(hf_config, "text_config", None) or hf_config
    head_dim = model_config.head_dim
    kv_heads = model_config.num_kv_heads
    cfg.head_dim = head_dim  # else derived from hidden_size / the now smaller head count
    cfg.num_attention_heads //= world_size
    cfg.num_key_value_heads = max(1, kv_heads // world_size)
    cfg.intermediate_size //= world_size
    cfg.vocab_size = -(-cfg.vocab_size // world_size)
    return dataclasses.replace(model_config, hf_config=hf_config)


def shard_tensor(
    full: torch.Tensor, local_shape: tuple[int, ...], rank: int, world_size: int, name: str
) -> torch.Tensor:
    """This rank's slice of a full checkpoint tensor for a parameter of `local_shape`.

    Along each dimension where the sizes differ the full size must be `ratio` times the local
    one with `ratio` dividing `world_size`: ratio = N splits evenly, a smaller ratio means the
    slice is replicated on N / ratio consecutive ranks (KV heads fewer than ranks)."""
    if full.dim() != len(local_shape):
        return full  # the parameter's own loader names the mismatch
    for dim, (size, part) in enumerate(zip(full.shape, local_shape, strict=True)):
        if size == part:
            continue
        if part == 0 or size % part or world_size % (size // part):
            raise ValueError(
                f"{name}: dimension {dim} of size {size} cannot be split into parts of {part} "
                f"over {world_size} tensor-parallel ranks"
            )
        ratio = size // part
        index = rank * ratio // world_size
        full = full.narrow(dim, index * part, part)
    return full


def _local_shape(param: nn.Parameter, layer: Any, shard_id: int | str | None) -> tuple[int, ...]:
    """The shape a checkpoint tensor must have to land in `param` (one output shard of it when
    `shard_id` names a fused projection's part)."""
    shape = list(param.shape)
    output_dim = getattr(param, "output_dim", None)
    if shard_id is not None and isinstance(layer, LinearBase) and output_dim is not None:
        index = layer._shard_index(shard_id)
        pack = getattr(param, "output_pack_factor", 1)
        shape[output_dim] = layer.out_features_per_shard[index] // pack
    return tuple(shape)


class VocabParallelEmbedding(VocabEmbedding):
    """The rows [vocab_start, vocab_start + vocab_size) of the table: ids outside give zeros,
    and the all-reduce over ranks assembles every token's row."""

    vocab_start: int
    group: TensorParallelGroup

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_size)  # [T]
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


class ModelSharder:
    """Shards a model built from `rank_model_config` as its weights load (see the module)."""

    def __init__(self, group: TensorParallelGroup, vocab_size: int) -> None:
        self.group = group
        self.vocab_size = vocab_size  # the full vocabulary: the gathered logits are cut to it

    def prepare(self, model: nn.Module) -> None:
        """Wrap the loaders and insert the collectives (call before the weights load)."""
        rank = self.group.rank
        vocab_params: set[int] = set()
        for name, module in model.named_modules():
            if isinstance(module, VocabEmbedding):
                # Same object, new forward: a tied LM head keeps sharing its weight.
                module.__class__ = VocabParallelEmbedding
                module.vocab_start = rank * module.vocab_size
                module.group = self.group
                vocab_params.add(id(module.weight))
            elif isinstance(module, LMHead):
                module.register_forward_hook(self._gather_logits)
                if not module.quantized:
                    vocab_params.add(id(module.weight))
            elif isinstance(module, LinearBase) and _ROW_PARALLEL.search(name):
                module.register_forward_hook(self._sum_partials)
                if module.bias is not None:
                    module.bias.tp_zero_on_rank = rank != 0  # added once, after the sum
        for name, param in model.named_parameters():
            param.weight_loader = self._sharded_loader(
                name, param, getattr(param, "weight_loader", None), id(param) in vocab_params
            )

    def _sharded_loader(
        self, name: str, param: nn.Parameter, original: Callable | None, vocab_rows: bool
    ) -> Callable:
        rank, world = self.group.rank, self.group.world_size
        layer = getattr(original, "__self__", None)

        def load(p: nn.Parameter, full: torch.Tensor, shard_id: int | str | None = None) -> None:
            local = _local_shape(p, layer, shard_id)
            if vocab_rows and full.dim() == len(local) and full.shape[0] < local[0] * world:
                # Vocabulary not divisible by N: zero rows pad the last rank's slice.
                full = F.pad(
                    full, (0, 0) * (full.dim() - 1) + (0, local[0] * world - full.shape[0])
                )
            sliced = shard_tensor(full, local, rank, world, name)
            if name.endswith("g_idx") and sliced.shape != full.shape:
                sliced = _local_g_idx(sliced, layer, rank, name)
            full = sliced
            if getattr(p, "tp_zero_on_rank", False):
                full = torch.zeros_like(full)
            if original is None:
                if p.shape != full.shape:
                    raise ValueError(
                        f"{name}: checkpoint tensor of shape {tuple(full.shape)} does not fit "
                        f"this rank's parameter of shape {tuple(p.shape)}"
                    )
                p.data.copy_(full)
            elif shard_id is None:
                original(p, full)
            else:
                original(p, full, shard_id)

        return load

    def shard(self, full: torch.Tensor, local_shape: tuple[int, ...], name: str) -> torch.Tensor:
        """This rank's slice of `full` for a tensor of `local_shape` (LoRA adapters)."""
        return shard_tensor(full, local_shape, self.group.rank, self.group.world_size, name)

    def _sum_partials(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(out)

    def _gather_logits(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last_dim(out)[..., : self.vocab_size]  # [N, V] float32


def _local_g_idx(g_idx: torch.Tensor, layer: Any, rank: int, name: str) -> torch.Tensor:
    """Group indices of a row-parallel slice, renumbered from this rank's first group.

    Only groups that follow the column order can be split along the input: with act-order a
    rank's columns would need scales of groups held by other ranks."""
    local_in = g_idx.numel()
    group = getattr(layer, "wna16_group_size", None)
    if not group or local_in % group:
        raise ValueError(f"{name}: cannot tell this rank's quantization groups from g_idx")
    local_groups = local_in // group
    shifted = g_idx - rank * local_groups
    if shifted.numel() and (int(shifted.min()) < 0 or int(shifted.max()) >= local_groups):
        raise ValueError(
            f"{name}: act-order (g_idx) groups span tensor-parallel ranks; this checkpoint "
            "cannot be split along the input dimension (use tensor_parallel_size=1 or a "
            "checkpoint quantized without act-order)"
        )
    return shifted
