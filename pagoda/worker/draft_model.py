"""The draft model of speculative decoding: a smaller model beside the target, in one worker.

It owns a paged KV cache of its own, laid out like the target's and addressed by the same block
tables and slot mapping, so the scheduler's blocks cover both. It runs every step's batch after
the target (prompt chunks, decodes and verify steps alike; 1-D positions over the token ids, also
for an M-RoPE target), then proposes k tokens per request greedily from the accepted ones.
On CUDA it replays graphs of its own (`capture_graphs`): decode graphs for the proposing steps
and the decode steps it follows, verify-shaped graphs (1 + k tokens a sequence) for the verify
steps; prompt chunks run eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagoda.layers.attention import AttentionMetadata, check_kv_cache_dtype
from pagoda.models.llama import bind_key_centers
from pagoda.models.loader import load_model
from pagoda.worker.memory import kv_bytes_per_block

if TYPE_CHECKING:
    from collections.abc import Callable

    from pagoda.config import ModelConfig


class DraftModel:
    # Whether the draft reads the target's features of the step (an EAGLE head,
    # pagoda.worker.eagle): it then follows the step after sampling, not beside the target.
    reads_target_features = False

    def __init__(
        self,
        model_config: ModelConfig,
        device: torch.device,
        kv_dtype: torch.dtype,
        block_size: int,
    ) -> None:
        self.model_config = model_config
        self.device = device
        self.kv_dtype = kv_dtype
        self.block_size = block_size
        self.model: Any = None
        self.kv_caches: list[torch.Tensor] = []
        self.weights_bytes = 0
        # Target ids past a smaller draft vocabulary (padding ids) are clamped into it.
        self.vocab_size: int = model_config.text_config.vocab_size
        # CUDA graphs by query length (1: decode / propose steps; 1 + k: verify steps)
        self.graphs: dict[int, Any] = {}

    def capture_graphs(
        self, max_num_seqs: int, max_model_len: int, query_lens: list[int], dtype: torch.dtype
    ) -> list:
        """Capture the draft's graphs for these query lengths (activations in `dtype`, the
        runner's); returns their stats."""
        from pagoda.worker.cuda_graphs import CudaGraphRunner

        stats = []
        cfg = self.model_config.text_config
        for q in query_lens:
            runner = CudaGraphRunner(
                self.model,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                block_size=self.block_size,
                hidden_size=cfg.hidden_size,
                dtype=dtype,
                device=self.device,
                query_len=q,
            )
            stats.append(runner.capture())
            self.graphs[q] = runner
        return stats

    def run_graph(
        self,
        query_len: int,
        token_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        table: np.ndarray,
        fill_ids: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor | None:
        """Replay the graph for len(seq_lens) sequences of `query_len` tokens; None where no
        graph fits (the caller runs eagerly)."""
        runner = self.graphs.get(query_len)
        if runner is None:
            return None
        size = runner.padded_size(len(seq_lens))
        if size is None:
            return None
        ids = np.minimum(token_ids, self.vocab_size - 1)
        fill = fill_ids
        if fill_ids is not None:  # ids written on the device are clamped there too

            def fill(buf: torch.Tensor) -> None:
                fill_ids(buf)
                buf.clamp_(max=self.vocab_size - 1)

        return runner.run(size, ids, positions, slots, seq_lens, table, fill_ids=fill)

    def load(self, target_window: int | None) -> None:
        """Load the weights. `target_window`: the window the KV manager frees the target's
        blocks by; the draft shares those blocks, so it must not look further back."""
        self.model = load_model(self.model_config, self.device)
        layers = self.model.attention_layers()
        check_kv_cache_dtype(layers, self.kv_dtype, self.device)
        if self.kv_dtype.itemsize == 1:  # FP8: keys stored minus their bias's mean (llama.py)
            bind_key_centers(self.model, self.model_config.max_model_len)
        if target_window is not None:
            windows = [layer.sliding_window for layer in layers]
            if None in windows or max(windows) > target_window:
                raise ValueError(
                    f"speculative draft model {self.model_config.model!r} attends further back "
                    f"than the target's sliding window ({target_window} tokens), whose blocks "
                    "it shares"
                )
        self.weights_bytes = sum(
            t.numel() * t.element_size()
            for t in list(self.model.parameters()) + list(self.model.buffers())
        )

    def kv_bytes_per_block(self) -> int:
        mc = self.model_config
        return kv_bytes_per_block(
            mc.num_layers, self.block_size, mc.num_kv_heads, mc.head_dim, self.kv_dtype.itemsize
        )

    def activation_bytes(self, num_tokens: int) -> int:
        """CPU estimate of one forward's activations over `num_tokens` (as the runner's)."""
        cfg = self.model_config.text_config
        inter = getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
        return num_tokens * (6 * cfg.hidden_size + 3 * inter) * 4

    def allocate_kv_cache(self, num_blocks: int, zero_all: bool = False) -> None:
        """Same blocks as the target's cache, zeroed as the runner zeroes the target's: the
        null block 0, or all of it (`zero_all`: the CUDA decode without Triton)."""
        mc = self.model_config
        shape = (2, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        layers = self.model.attention_layers()
        self.kv_caches = [
            torch.empty(shape, dtype=self.kv_dtype, device=self.device) for _ in layers
        ]
        for layer, cache in zip(layers, self.kv_caches, strict=True):
            if zero_all:
                cache.view(torch.uint8).zero_()
            else:
                cache.view(torch.uint8)[:, 0].zero_()
            layer.kv_cache = cache

    def release_kv_cache(self) -> None:
        if self.model is not None:
            for layer in self.model.attention_layers():
                layer.kv_cache = None
        self.kv_caches = []

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> None:
        """Run the target's step batch: writes the draft's KV at the step's slots. Drafts the
        target rejects leave stale entries that the steps recomputing those positions
        overwrite, as in the target's cache."""
        self.model(ids.clamp(max=self.vocab_size - 1), positions, md)

    def propose(
        self,
        token_ids: list[int],
        positions: list[int],
        table: np.ndarray,
        num_tokens: list[int],
        to_dev: Callable[[np.ndarray], torch.Tensor],
    ) -> list[list[int]]:
        """Greedy drafts, `num_tokens[i]` for row i, from each row's newest token
        `token_ids[i]` at `positions[i]` (all earlier positions in the cache).

        `table`: [B, max_blocks] block-table rows covering every position written (the
        scheduler allocates k slots of lookahead). Greedy drafts make q one-hot, which the
        rejection sampler expects; the target's distribution is kept exactly either way.
        """
        bs = self.block_size
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        pos = np.asarray(positions, dtype=np.int64)
        want = np.asarray(num_tokens, dtype=np.int64)
        rows = np.arange(len(token_ids))  # the batch rows still drafting
        steps: list[tuple[np.ndarray, torch.Tensor]] = []  # (batch rows, their drafts)
        host_ids = ids.clamp(max=self.vocab_size - 1).numpy()
        ids = None  # on the device: the previous step's argmax (step 0 eager: copied in)
        for step in range(int(want.max())):
            if step:
                keep = want[rows] > step
                if not keep.all():
                    rows = rows[keep]
                    ids = ids[to_dev(np.flatnonzero(keep))]
            p = pos[rows] + step
            n = len(rows)
            seq_lens = (p + 1).astype(np.int32)
            max_blocks = int(-(-int(seq_lens.max()) // bs))
            sub = table[rows, :max_blocks]  # [n, max_blocks]
            slots = sub[np.arange(n), p // bs].astype(np.int64) * bs + p % bs
            # the ids of step > 0 are on the device (the previous argmax): copied in there
            fill = None if step == 0 else (lambda buf, ids=ids: buf.copy_(ids))
            hidden = self.run_graph(
                1, host_ids[rows] if step == 0 else np.zeros(n, np.int64), p, slots, seq_lens,
                np.ascontiguousarray(sub), fill,
            )  # fmt: skip
            if hidden is not None:
                ids = self.model.compute_logits(hidden).argmax(dim=-1)  # [n]
                steps.append((rows, ids))
                continue
            if ids is None:  # step 0, eager
                ids = to_dev(host_ids)
            qsl = np.arange(n + 1, dtype=np.int32)
            md = AttentionMetadata(
                num_actual_tokens=n,
                query_start_loc=to_dev(qsl),
                seq_lens=to_dev(seq_lens),
                block_tables=to_dev(np.ascontiguousarray(sub)),
                slot_mapping=to_dev(slots),
                max_query_len=1,
                max_seq_len=int(seq_lens.max()),
                query_start_loc_cpu=qsl.tolist(),
                seq_lens_cpu=seq_lens.tolist(),
            )
            hidden = self.model(ids, to_dev(p), md)  # [n, hidden]
            ids = self.model.compute_logits(hidden).argmax(dim=-1)  # [n]
            steps.append((rows, ids))
        drafts: list[list[int]] = [[] for _ in token_ids]
        for rows, ids in steps:  # one copy to the host at the end
            for row, t in zip(rows.tolist(), ids.tolist(), strict=True):
                drafts[row].append(t)
        return drafts

    def close(self) -> None:
        for runner in self.graphs.values():
            runner.close()
        self.graphs = {}
        self.release_kv_cache()
        self.model = None
