"""The draft model of speculative decoding: a smaller model beside the target, in one worker.

It owns a paged KV cache of its own, laid out like the target's and addressed by the same block
tables and slot mapping, so the scheduler's blocks cover both. It runs every step's batch after
the target (prompt chunks, decodes and verify steps alike; 1-D positions over the token ids, also
for an M-RoPE target), then proposes k tokens per request greedily from the accepted ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagoda.layers.attention import AttentionMetadata, check_kv_cache_dtype
from pagoda.models.loader import load_model
from pagoda.platform import capability as platform_capability
from pagoda.worker.memory import kv_bytes_per_block

if TYPE_CHECKING:
    from collections.abc import Callable

    from pagoda.config import ModelConfig


class DraftModel:
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

    def load(self, target_window: int | None) -> None:
        """Load the weights. `target_window`: the window the KV manager frees the target's
        blocks by; the draft shares those blocks, so it must not look further back."""
        self.model = load_model(self.model_config, self.device)
        layers = self.model.attention_layers()
        check_kv_cache_dtype(layers, self.kv_dtype, self.device, platform_capability())
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
        ids = to_dev(ids.clamp(max=self.vocab_size - 1).numpy())
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
        self.release_kv_cache()
        self.model = None
