"""CUDA graphs for decode-only steps: one captured forward per padded batch size.

A decode step launches hundreds of small kernels; replaying a captured graph removes the launch
gaps. Inputs live in static buffers that each step overwrites; a batch of n requests runs the
graph of the smallest captured size >= n, the padding rows being one-token "sequences" that read
the null block and write nowhere (slot -1). Attention's split-KV factor is fixed per graph at
capture (chunks are sized from the real lengths at replay), so one graph serves every length.
The torch attention (Triton absent) reads each row's whole captured block table, so there a size
gets one graph per context bucket (1 Ki, 2 Ki, ... tokens up to max_model_len) and a replay
takes the smallest bucket that holds the step's longest sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.layers.attention import AttentionMetadata
from pagoda.platform import num_sms, triton_available
from pagoda.worker.host_staging import PinnedStaging

DEFAULT_CAPTURE_SIZES = (
    1,
    2,
    4,
    8,
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    160,
    192,
    224,
    256,
    320,
    384,
    448,
    512,
)


@dataclass
class GraphCaptureStats:
    sizes: list[int]
    capture_time_s: float
    memory_bytes: int


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        sizes: Sequence[int] = DEFAULT_CAPTURE_SIZES,
        context_buckets: bool = False,
        query_len: int = 1,
    ) -> None:
        self.model = model
        # Tokens per sequence: 1 for decode graphs, 1 + k for speculative verify graphs (the
        # last known token and k drafts of every sequence; padding sequences read the null block).
        self.query_len = q = query_len
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        self.sizes = sorted({s for s in sizes if s <= max_num_seqs} | {min(max_num_seqs, 512)})
        max_bs = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        # block-table widths captured (ascending); the last one covers max_model_len
        self.widths = [self.max_blocks]
        if context_buckets:
            tokens = range(10, max(10, (max_model_len - 1).bit_length()))
            self.widths = sorted({-(-(1 << t) // block_size) for t in tokens} | {self.max_blocks})
            self.widths = [w for w in self.widths if w <= self.max_blocks]
        # [max_bs] static inputs; a replay reads whatever the step copied in
        self.input_ids = torch.zeros(max_bs * q, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs * q, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_bs * q,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device) * q
        self.seq_lens = torch.full((max_bs,), q, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, self.max_blocks, dtype=torch.int32, device=device)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # by (size, width)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.stats: GraphCaptureStats | None = None
        # The runner's pinned staging buffer (host_staging.py); None: a pinned copy per array.
        self.staging: PinnedStaging | None = None

    def _metadata(self, size: int, width: int) -> AttentionMetadata:
        num_splits = None  # the split-KV factor only means something to the Triton kernels
        if triton_available():
            from pagoda.kernels.attention.triton_paged_attention import (
                choose_num_splits,
                effective_kv_len,
            )

            layer = self.model.attention_layers()[0]
            # A sliding window caps the keys a decode reads (the window is the layer's, a
            # kernel argument baked into the graph like the rest of the layer's parameters).
            kv_len = effective_kv_len(self.max_model_len, 1, layer.sliding_window)
            sms = num_sms(self.device)
            num_splits = choose_num_splits(size, layer.num_kv_heads, self.query_len, kv_len, sms)
        q = self.query_len
        return AttentionMetadata(
            num_actual_tokens=size * q,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size, :width],
            slot_mapping=self.slot_mapping[: size * q],
            max_query_len=q,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(0, (size + 1) * q, q)),
            seq_lens_cpu=[q] * size,
            num_splits=num_splits,
            uniform_query_len=q > 1,
        )

    @torch.inference_mode()
    def capture(self) -> GraphCaptureStats:
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        # largest first: smaller graphs reuse its pool
        for size, width in [(s, w) for s in reversed(self.sizes) for w in reversed(self.widths)]:
            md = self._metadata(size, width)
            tokens = size * self.query_len
            args = (self.input_ids[:tokens], self.positions[:tokens], md)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: autotuning and lazy init stay out of the graph
                    self.model(*args)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(*args)
            self.graphs[size, width] = graph
            self.outputs[size, width] = out
        torch.cuda.synchronize(self.device)
        self.stats = GraphCaptureStats(
            sizes=list(self.sizes),
            capture_time_s=time.perf_counter() - t0,
            memory_bytes=max(0, free_before - torch.cuda.mem_get_info(self.device)[0]),
        )
        return self.stats

    def close(self) -> None:
        """Drop the graphs (their private memory pool goes with the last one) and the static
        buffers; the runner frees the rest."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.sizes = []
        self.model = None
        for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens"):
            setattr(self, name, None)
        self.block_tables = None

    def padded_size(self, num_reqs: int) -> int | None:
        for s in self.sizes:
            if s >= num_reqs:
                return s
        return None

    def run(
        self,
        size: int,
        token_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        block_table: np.ndarray,
        fill_ids: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Replay the graph of `size` for n = len(seq_lens) sequences of `query_len` tokens
        each; hidden [n * query_len, H].

        `fill_ids` writes device-side inputs (tokens sampled by the previous step, not yet on the
        host) into the graph's input ids before the replay.
        """
        q = self.query_len
        n = len(seq_lens)
        pad = (size - n) * q
        ids = np.pad(token_ids, (0, pad))
        pos = np.pad(positions, (0, pad))
        slot = np.pad(slots, (0, pad), constant_values=-1)
        lens = np.pad(seq_lens, (0, size - n), constant_values=q)
        nb = block_table.shape[1]
        table = np.zeros((size, nb), dtype=np.int32)
        table[:n] = block_table
        # Columns past `nb` may hold stale ids from earlier steps: never read, since a row only
        # reads the blocks its seq_len covers (padding rows: column 0, set to the null block).
        host = _pinned if self.staging is None else self.staging.stage
        self.input_ids[: size * q].copy_(host(ids), non_blocking=True)
        self.positions[: size * q].copy_(host(pos), non_blocking=True)
        self.slot_mapping[: size * q].copy_(host(slot), non_blocking=True)
        self.seq_lens[:size].copy_(host(lens), non_blocking=True)
        self.block_tables[:size, :nb].copy_(host(table), non_blocking=True)
        if fill_ids is not None:
            fill_ids(self.input_ids[: n * q])
        width = next(w for w in self.widths if w >= nb)
        self.graphs[size, width].replay()
        return self.outputs[size, width][: n * q]


def _pinned(arr: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(arr)).pin_memory()
