"""LoRAManager: adapters registered by key, kept in `max_loras` device slots (LRU).

It wraps every linear layer of a built model with `LoRALinearMethod`, maps each adapter's
PEFT module names onto those layers (fused q/k/v and gate/up shards included), checks ranks
and shapes when the adapter is registered (so errors reach the caller of `generate`), and
before each step loads the batch's adapters into slots and writes the per-token slot table.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.config import LoRAConfig
from pagoda.layers.linear import LinearBase
from pagoda.lora.adapter import canonical_name, load_adapter
from pagoda.lora.layers import LoRABatch, LoRALinearMethod

logger = logging.getLogger("pagoda")

# Vision towers run in their own pass over image patches, outside the step's token layout that
# the slot table describes: their layers are never wrapped (adapters on them must be merged).
_VISION_PREFIXES = ("visual.", "vision_tower.")
# Per wrapped layer, per output shard: (A [r, in], scale * B [n_shard, r]) or None.
_LayerPairs = list[tuple[torch.Tensor, torch.Tensor] | None]


@dataclass
class _Adapter:
    key: str
    path: str
    layers: dict[str, _LayerPairs]  # our module name -> pairs, only layers the adapter targets


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        lora_config: LoRAConfig,
        max_num_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = lora_config
        self.dtype = dtype
        # Tensor parallelism: (full tensor, this rank's shape, name) -> this rank's slice
        # (`ModelSharder.shard`); None keeps adapters whole.
        self.shard_tensor: Callable[[torch.Tensor, tuple[int, ...], str], torch.Tensor] | None = (
            None
        )
        self.device = device
        self.batch = LoRABatch(max_num_tokens, device)
        self.methods: dict[str, LoRALinearMethod] = {}
        # canonical HF module path (e.g. model.layers.0.self_attn.k_proj) -> (our layer, shard)
        self.targets: dict[str, tuple[str, int]] = {}
        packed = getattr(model, "packed_modules_mapping", {})
        for name, module in model.named_modules():
            if not isinstance(module, LinearBase):
                continue
            if canonical_name(name).startswith(_VISION_PREFIXES):
                continue
            parent, _, leaf = name.rpartition(".")
            hf_leaves = packed.get(leaf, [leaf])
            if len(hf_leaves) != len(module.out_features_per_shard):
                continue  # a fused layer this mapping does not describe: never targeted
            method = LoRALinearMethod(
                module.linear_method,
                module,
                self.batch,
                lora_config.max_loras,
                lora_config.max_lora_rank,
                dtype,
                device,
            )
            module.linear_method = method
            self.methods[name] = method
            for shard, hf_leaf in enumerate(hf_leaves):
                hf_name = f"{parent}.{hf_leaf}" if parent else hf_leaf
                self.targets[canonical_name(hf_name)] = (name, shard)
        self.registered: dict[str, str] = {}  # key -> adapter path
        self.cache: OrderedDict[str, _Adapter] = OrderedDict()  # host copies, LRU
        self.slot_keys: list[str | None] = [None] * lora_config.max_loras
        self.slot_lru: OrderedDict[str, int] = OrderedDict()  # key -> slot, oldest first

    @property
    def buffer_bytes(self) -> int:
        return sum(
            m.lora_a.numel() * m.lora_a.element_size() + m.lora_b.numel() * m.lora_b.element_size()
            for m in self.methods.values()
        )

    # ------------------------------------------------------------------ adapters

    def add_adapter(self, key: str, path: str) -> None:
        """Register (and validate) an adapter; a key already registered must keep its path."""
        known = self.registered.get(key)
        if known is not None:
            if known != path:
                raise ValueError(
                    f"adapter id {key!r} is already registered with path {known!r}, not {path!r}"
                )
            return
        self._cache(self._load(key, path))
        self.registered[key] = path

    def _load(self, key: str, path: str) -> _Adapter:
        adapter = load_adapter(path)
        where = f"adapter {path!r}"
        if adapter.full_tensors:
            names = ", ".join(sorted(adapter.full_tensors)[:5])
            raise ValueError(
                f"{where} also trains full tensors ({names}): serving it unmerged is not "
                "supported; merge it with `pagoda lora merge`"
            )
        layers: dict[str, _LayerPairs] = {}
        for module in adapter.modules.values():
            target = self.targets.get(canonical_name(module.name))
            if target is None:
                raise ValueError(
                    f"{where}: module {module.name!r} is not a linear layer of the served model "
                    "(unmerged serving covers the decoder's q/k/v/o and gate/up/down "
                    "projections); "
                    f"merge it with `pagoda lora merge`{adapter.describe_base()}"
                )
            if module.kind != "linear" or module.fan_in_fan_out or module.lora_b_bias is not None:
                raise ValueError(
                    f"{where}: module {module.name!r} uses a LoRA form that only merging "
                    "supports (embedding/conv, fan_in_fan_out or lora_bias)"
                )
            if module.rank > self.config.max_lora_rank:
                raise ValueError(
                    f"{where}: module {module.name!r} has rank {module.rank}, more than "
                    f"max_lora_rank={self.config.max_lora_rank}; raise max_lora_rank"
                )
            layer, shard = target
            method = self.methods[layer]
            in_features = method.lora_a.shape[2]
            out_features = method.shard_sizes[shard]
            a, b = module.lora_a, module.lora_b
            if self.shard_tensor is not None:
                # Column-parallel layers split B's rows, row-parallel ones A's columns; the
                # layer's all-reduce then sums the partial low-rank terms with the base output.
                a = self.shard_tensor(a, (a.shape[0], in_features), module.name)
                b = self.shard_tensor(b, (out_features, b.shape[1]), module.name)
            if a.shape[1] != in_features or b.shape[0] != out_features:
                raise ValueError(
                    f"{where}: module {module.name!r} has lora_A {tuple(a.shape)} and lora_B "
                    f"{tuple(b.shape)}, but the model's layer maps {in_features} -> "
                    f"{out_features} features; the adapter was trained for another base model"
                    f"{adapter.describe_base()}"
                )
            pairs = layers.setdefault(layer, [None] * len(method.shard_sizes))
            # Host copies in the model dtype, the scale folded into B (one multiply, here).
            pairs[shard] = (
                a.to(self.dtype).contiguous(),
                (b.float() * module.scale).to(self.dtype).contiguous(),
            )
        return _Adapter(key=key, path=path, layers=layers)

    def _cache(self, adapter: _Adapter) -> None:
        self.cache[adapter.key] = adapter
        self.cache.move_to_end(adapter.key)
        while len(self.cache) > self.config.max_cpu_loras:
            self.cache.popitem(last=False)  # re-read from its path when needed again

    def remove_adapter(self, key: str) -> None:
        self.registered.pop(key, None)
        self.cache.pop(key, None)
        slot = self.slot_lru.pop(key, None)
        if slot is not None:
            self.slot_keys[slot] = None

    # ------------------------------------------------------------------ per step

    def _slot_of(self, key: str, in_use: set[str]) -> int:
        slot = self.slot_lru.get(key)
        if slot is not None:
            self.slot_lru.move_to_end(key)
            return slot
        if None in self.slot_keys:
            slot = self.slot_keys.index(None)
        else:
            # The least recently used adapter that this step does not need.
            victim = next((k for k in self.slot_lru if k not in in_use), None)
            if victim is None:
                raise RuntimeError(
                    f"a step uses more than max_loras={self.config.max_loras} adapters"
                )
            slot = self.slot_lru.pop(victim)
        adapter = self.cache.get(key)
        if adapter is None:
            path = self.registered.get(key)
            if path is None:
                raise KeyError(f"adapter {key!r} was never registered")
            adapter = self._load(key, path)
            self._cache(adapter)
        for name, method in self.methods.items():
            pairs = adapter.layers.get(name)
            method.set_slot(slot, pairs or [])
        self.slot_keys[slot] = key
        self.slot_lru[key] = slot
        return slot

    def prepare(
        self, keys: list[str | None], num_tokens: list[int], padded: int | None = None
    ) -> None:
        """Activate the step's adapters and write its slot table.

        `padded` is given for decode-only steps (one token per request), run per token; the
        rows past `len(keys)` are CUDA-graph padding.
        """
        in_use = {k for k in keys if k is not None}
        slots = [-1 if k is None else self._slot_of(k, in_use) for k in keys]
        if padded is not None:
            self.batch.set_per_token(slots, padded)
        else:
            self.batch.set_per_request(slots, num_tokens)
