"""Programmatic dependent launch (PDL) for the Triton kernels of the decode path (sm_90+).

A decode step of a 7B model at batch 1 is ~300 small dependent kernels; between two of them the
GPU drains the first, flushes its writes and only then launches the second, ~1-3 µs each. With
PDL a kernel is launched while its predecessor still runs: its programs become resident, then
wait in `gdc_wait()` (griddepcontrol.wait) until the predecessor has completed and its memory is
visible. The launch latency overlaps the predecessor's tail. CUDA-graph capture keeps these
programmatic edges.

The contract, for every kernel launched with `**pdl_launch_args(t)`:
- its first memory access comes after `if USE_PDL: tl.extra.cuda.gdc_wait()`, except reads of
  tensors no kernel of the step's chain writes: model weights (the tensor-core W4A16 GEMV
  loads its first weight tile before waiting), the step's host-copied inputs and the layer's
  own KV cache (the fused decode attention reads sequence lengths and block table and
  prefetches cache blocks). The part before the wait may overlap any earlier kernel still
  running, not only the predecessor;
- it may call `gdc_launch_dependents()` at any point (after its inputs are read, or first
  thing: `PDL_EARLY`); the successor still waits for its completion in its own `gdc_wait()`, so
  this only lets the successor launch early. A successor launched early holds its SM resources
  while it waits, which is why only short kernels trigger first thing.
Because every PDL kernel waits for its predecessor before touching memory, ordering stays
transitive: kernel C (after B after A) cannot start reading before A has completed.
Kernels launched without the flag (cuBLAS, torch ops) keep ordinary stream order.

`PAGODA_PDL=0` turns it off (A/B measurements); it is off on the CPU, under the Triton
interpreter and on GPUs before Hopper.
"""

from __future__ import annotations

import functools

import torch

from pagoda import envs
from pagoda.platform import capability, triton_available


@functools.cache
def _device_supports_pdl(index: int) -> bool:
    if not envs.pdl() or envs.triton_interpret():
        return False
    if capability(index)[0] < 9 or not triton_available():
        return False
    try:
        import triton.language as tl

        return hasattr(tl.extra.cuda, "gdc_wait") and hasattr(
            tl.extra.cuda, "gdc_launch_dependents"
        )
    except (ImportError, AttributeError):
        return False


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels whose operands live with `t` launch with PDL."""
    if not t.is_cuda:
        return False
    return _device_supports_pdl(t.device.index if t.device.index is not None else 0)


@functools.cache
def _early_enabled() -> bool:
    return envs.pdl_early()


def pdl_launch_args(t: torch.Tensor, early: bool = False) -> dict:
    """Keyword arguments for a Triton launch: the kernel's `USE_PDL` constexpr and the flag.

    `early=True` (kernels with a `PDL_EARLY` constexpr: the short kernels between two GEMVs)
    adds `PDL_EARLY`: trigger `gdc_launch_dependents()` first thing, before `gdc_wait()`, so the
    next kernel (a weight GEMV) is resident while this one waits and runs, and starts streaming
    its weights into the L2 then (`PAGODA_PDL_EARLY=0`: trigger after the inputs are read)."""
    on = pdl_enabled(t)
    args = {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}
    if early:
        args["PDL_EARLY"] = on and _early_enabled()
    return args
