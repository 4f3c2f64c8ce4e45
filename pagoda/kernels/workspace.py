"""Scratch of the split-K kernels' "serial" reduction, as an object its owner passes in.

A split-K GEMV's programs add fp32 partials into a workspace and count arrivals per column tile;
the last program of a tile reads the sums back, stores the output and zeroes what it used, so
the buffers stay zero between calls and one pair serves every layer of a stream (CUDA graphs
included). The model runner owns one `SplitKWorkspace` and binds it to its linear layers
(`layer.split_k_workspace`); kernels take it as `workspace=`.
"""

from __future__ import annotations

import torch


class SplitKWorkspace:
    """fp32 partials and int32 counters per device, grown (never shrunk) outside capture."""

    def __init__(self) -> None:
        # (device type, index) -> every pair ever allocated: captured graphs point at old ones.
        self._pairs: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @staticmethod
    def _key(device: torch.device) -> tuple[str, int]:
        index = device.index
        if index is None:
            index = torch.cuda.current_device() if device.type == "cuda" else 0
        return device.type, index

    @staticmethod
    def _capturing(device: torch.device) -> bool:
        return device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def buffers(
        self, device: torch.device, numel: int, tiles: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(fp32 [>= numel], int32 [>= tiles]) zeroed buffers on `device`; None when a CUDA
        graph is being captured and the current pair is too small (the caller then takes its
        capture-safe reduction). The engine's warm-up runs before capture allocate them."""
        pairs = self._pairs.setdefault(self._key(device), [])
        if pairs and pairs[-1][0].numel() >= numel and pairs[-1][1].numel() >= tiles:
            return pairs[-1]
        if self._capturing(device):
            return None
        last_ws, last_cnt = pairs[-1] if pairs else (None, None)
        size = max(numel, 1 << 20, 2 * (last_ws.numel() if last_ws is not None else 0))
        n_cnt = max(tiles, 1 << 12, 2 * (last_cnt.numel() if last_cnt is not None else 0))
        pair = (
            torch.zeros(size, device=device, dtype=torch.float32),
            torch.zeros(n_cnt, device=device, dtype=torch.int32),
        )
        pairs.append(pair)
        return pair

    def all_buffers(self) -> list[torch.Tensor]:
        """Every buffer allocated so far (tests check that they are zero again)."""
        return [t for pairs in self._pairs.values() for pair in pairs for t in pair]
