"""What the machine is: device resolution, compute capability, SM count, integrated (unified-
memory) GPUs and whether Triton can be used.

One place for these questions, so the worker, the kernel registries and the quantizer agree and
no kernel hard-codes an SM count. Importing this module never imports Triton.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from pagoda import envs


def resolve_device(device: str | torch.device) -> torch.device:
    """ "auto" -> CUDA when available, else CPU; a clear ValueError for anything unusable."""
    if isinstance(device, torch.device):
        device = str(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        msg = f"device={device!r} is not a device; use 'auto', 'cpu' or 'cuda'"
        raise ValueError(msg) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; use 'auto', 'cpu' or 'cuda'")
    return dev


def _index(device: torch.device | int | None) -> int:
    if isinstance(device, int):
        return device
    if device is None or device.index is None:
        return torch.cuda.current_device()
    return device.index


def capability(device: torch.device | int | None = None) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device; (0, 0) for the CPU."""
    if isinstance(device, torch.device) and device.type != "cuda":
        return (0, 0)
    if not torch.cuda.is_available():
        return (0, 0)
    return _capability(_index(device))


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    real = tuple(torch.cuda.get_device_capability(index))
    emulated = envs.emulated_capability()
    if emulated is None:
        return real  # type: ignore[return-value]
    if emulated > real:
        raise ValueError(
            f"PAGODA_EMULATE_CAPABILITY={emulated[0]}.{emulated[1]} is above the device's "
            f"{real[0]}.{real[1]}: only an older GPU's kernels can be emulated"
        )
    return emulated


def num_sms(device: torch.device | int | None = None) -> int:
    """Streaming multiprocessors of a CUDA device (kernels size their grids by it)."""
    return _num_sms(_index(device))


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def l2_bytes(device: torch.device | int | None = None) -> int:
    """The L2 cache of a CUDA device in bytes (0 where torch does not report it)."""
    return _l2_bytes(_index(device))


@functools.cache
def _l2_bytes(index: int) -> int:
    return int(getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0) or 0)


def is_integrated_gpu(device: torch.device) -> bool:
    """Jetson-class GPUs share system RAM with the CPU (unified memory)."""
    return device.type == "cuda" and bool(
        getattr(torch.cuda.get_device_properties(device), "is_integrated", False)
    )


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (for modules that keep torch out of their imports)."""
    return torch.cuda.is_available()


@functools.cache
def triton_available() -> bool:
    """Whether the `triton` package is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def cpu_has_bf16_gemm() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AMX / AVX512-BF16, oneDNN's own
    check): there a bf16 GEMM runs about 4x its float32 one; elsewhere bf16 is emulated and
    slower than float32."""
    mkldnn = torch.backends.mkldnn
    if not mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
