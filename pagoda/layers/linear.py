"""Linear layers whose weights are created and applied by a pluggable `LinearMethod`.

A layer owns the shapes (output shards, bias); its `LinearMethod` owns the parameters and the
matmul, so a quantized method (W4A16, ...) can replace `UnquantizedLinearMethod` per layer.
Fused layers (`QKVLinear`, `MergedColumnLinear`) hold several HF projections in one weight and
load each shard through `weight_loader(param, loaded_weight, shard_id)`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import envs, platform


class LinearMethod:
    """Creates a linear layer's parameters and computes `x @ W^T + b` with them.

    Parameters a method registers carry two attributes the fused loaders read:
    `output_dim` (the axis that runs over output features, or None when the parameter is not
    split by output shard) and `output_pack_factor` (output features per stored element along
    that axis, e.g. 8 for int4 packed in int32; 1 when unpacked). A parameter with
    `shard_indexed` holds one entry per shard (a per-tensor scale each): shard i fills entry i.
    """

    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features_per_shard: list[int],
        dtype: torch.dtype,
    ) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Hook for repacking after all shards are loaded (no-op when unquantized)."""


# Chooses the method of the linear layer at a module prefix (e.g. "model.layers.0.mlp.down_proj").
LinearMethodFactory = Callable[[str], LinearMethod]


def set_weight_attrs(param: nn.Parameter, output_dim: int | None, pack_factor: int = 1) -> None:
    """Tag a parameter with how fused loaders split it by output shard."""
    param.output_dim = output_dim
    param.output_pack_factor = pack_factor


class UnquantizedLinearMethod(LinearMethod):
    """Dense weight [out, in] in the model dtype; `F.linear` (cuBLAS on GPU)."""

    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features_per_shard: list[int],
        dtype: torch.dtype,
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(out_features_per_shard), in_features, dtype=dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, output_dim=0)
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = layer.weight
        if x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and w.dtype in _GEMV_DTYPES:
            gemv = dense_gemv_kernel(x.device)
            if gemv is not None:
                workspace = getattr(layer, "split_k_workspace", None)  # bound by the runner
                return gemv.gemv_bf16(x, w, bias, workspace=workspace)
        return F.linear(x, w, bias)


_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def dense_gemv_kernel(device: torch.device) -> ModuleType | None:
    """`pagoda.kernels.dense.triton_gemv` where the dense GEMV serves M = 1 on `device` (kernel name
    "dense_gemv"): CUDA sm_90+, where it measured faster than cuBLAS on every layer (H200);
    None elsewhere, without Triton, or when disabled."""
    if device.type != "cuda":
        return None
    return _dense_gemv_for(
        device.index if device.index is not None else torch.cuda.current_device()
    )


@functools.cache
def _dense_gemv_for(index: int) -> ModuleType | None:
    # Cached per process: the switch and the capability are read once.
    if not envs.kernel_enabled("dense_gemv") or platform.capability(index) < (9, 0):
        return None
    if not platform.triton_available():
        return None
    try:
        from pagoda.kernels.dense import triton_gemv
    except ImportError:
        return None
    from pagoda.kernels.dense import triton_gemv

    return triton_gemv


def default_linear_method_factory(prefix: str) -> LinearMethod:
    """Every layer unquantized."""
    return UnquantizedLinearMethod()


class LinearBase(nn.Module):
    """A linear layer with `len(out_features_per_shard)` output shards stored back to back."""

    def __init__(
        self,
        in_features: int,
        out_features_per_shard: list[int],
        bias: bool = False,
        linear_method: LinearMethod | None = None,
        dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features_per_shard = list(out_features_per_shard)
        self.out_features = sum(self.out_features_per_shard)
        self.prefix = prefix
        self.params_dtype = dtype or torch.get_default_dtype()
        self.linear_method = linear_method or UnquantizedLinearMethod()
        self.linear_method.create_weights(
            self, in_features, self.out_features_per_shard, self.params_dtype
        )
        if bias:
            # Biases stay in the model dtype whatever the weight format.
            self.bias = nn.Parameter(
                torch.empty(self.out_features, dtype=self.params_dtype), requires_grad=False
            )
            set_weight_attrs(self.bias, output_dim=0)
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return self.linear_method.apply(self, x, self.bias)

    def _shard_index(self, shard_id: int | str | None) -> int | None:
        if shard_id is None:
            return None
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.out_features_per_shard):
            raise ValueError(f"{self.prefix}: invalid shard id {shard_id!r}")
        return shard_id

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
        shard_id: int | str | None = None,
    ) -> None:
        """Copy a checkpoint tensor into `param`, or into one output shard of it."""
        index = self._shard_index(shard_id)
        target = param.data
        output_dim = getattr(param, "output_dim", None)
        if index is not None and output_dim is not None:
            pack = getattr(param, "output_pack_factor", 1)
            offset = sum(self.out_features_per_shard[:index]) // pack
            size = self.out_features_per_shard[index] // pack
            target = target.narrow(output_dim, offset, size)
        elif index is not None and getattr(param, "shard_indexed", False):
            target = target.narrow(0, index, 1)  # one scalar per shard (FP8 per-tensor scales)
        if target.shape != loaded_weight.shape:
            raise ValueError(
                f"{self.prefix}: checkpoint tensor of shape {tuple(loaded_weight.shape)} does not "
                f"fit parameter (shard {shard_id!r}) of shape {tuple(target.shape)}"
            )
        target.copy_(loaded_weight)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features_per_shard}, "
            f"bias={self.bias is not None}, method={type(self.linear_method).__name__}"
        )


class ReplicatedLinear(LinearBase):
    """A plain linear layer (one shard): o_proj, down_proj and unfused projections."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        linear_method: LinearMethod | None = None,
        dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(in_features, [out_features], bias, linear_method, dtype, prefix)


class MergedColumnLinear(LinearBase):
    """Several projections of the same input fused along the output (gate_up_proj).

    Shard ids are the integer positions in `out_features_per_shard`.
    """


class QKVLinear(LinearBase):
    """Fused q/k/v projection: output [q (H*D) | k (Hkv*D) | v (Hkv*D)], shard ids "q", "k", "v"."""

    _SHARDS = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        linear_method: LinearMethod | None = None,
        dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(
            hidden_size,
            [self.q_size, self.kv_size, self.kv_size],
            bias,
            linear_method,
            dtype,
            prefix,
        )

    def _shard_index(self, shard_id: int | str | None) -> int | None:
        if isinstance(shard_id, str):
            if shard_id not in self._SHARDS:
                raise ValueError(f"{self.prefix}: invalid shard id {shard_id!r}, use q, k or v")
            return self._SHARDS.index(shard_id)
        return super()._shard_index(shard_id)
