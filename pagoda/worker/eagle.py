"""The EAGLE head as the draft of speculative decoding (pagoda.models.eagle for the head).

Like the draft model it owns a paged KV cache addressed by the target's block tables and slot
mapping, and it follows every step. Its entry at position i needs token i+1, which for the
step's last row is only known once the step has sampled (or verified): so it runs after the
target's sampler, entirely on the device, with each row's next token — the next input row,
the next prompt token of a chunk, the sampled token, or for verify rows the token the
rejection sampler emitted there (rows past the first rejection get stale tokens, and steps
that recompute those positions overwrite their entries, as in the target's cache). It keeps
its output rows of the requests that may propose next; `propose` starts from the row of each
request's newest accepted position, whose f̂ gives the first draft, and chains the head for
the rest (writing the KV of lookahead slots that the next step rewrites).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagoda.layers.attention import AttentionMetadata, check_kv_cache_dtype
from pagoda.models.eagle import load_eagle_head
from pagoda.models.llama import bind_key_centers
from pagoda.worker.draft_model import DraftModel

if TYPE_CHECKING:
    from collections.abc import Callable


@dataclass
class EagleInputs:
    """One step's head inputs, built at launch; the sampled / verified tokens arrive later."""

    features: torch.Tensor  # [T, H]: the target's step rows (what its lm_head reads)
    next_ids: torch.Tensor  # [T] int64: token i+1 of each row, as far as known at launch
    positions: torch.Tensor  # [T] int64
    md: AttentionMetadata  # the target's step metadata (same slots and block tables)
    keep: torch.Tensor  # [K] int64: the rows kept for proposing
    kept: dict[str, tuple[int, int, int]]  # req_id -> (first kept row, its position, count)
    sampled_rows: torch.Tensor | None  # [S]: rows whose next token is the sampler's, in order
    verify_rows: torch.Tensor | None  # [R]: rows whose next token the rejection sampler emits
    verify_tokens: torch.Tensor | None = None  # [R] its output, once verified


class EagleDraft(DraftModel):
    """A DraftModel whose model is an EAGLE head reading the target's features."""

    reads_target_features = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.target: Any = None  # embed_tokens and compute_logits come from it
        self.kept: torch.Tensor | None = None  # [K, H]: f̂ rows of the last step
        self.kept_rows: dict[str, tuple[int, int, int]] = {}

    def load(self, target_window: int | None, target: Any = None) -> None:
        """Load the head (in the target's dtype), with the target's sliding window if any."""
        assert target is not None, "an EAGLE head needs the target model"
        self.target = target
        self.model = load_eagle_head(self.model_config, self.device, target_window)
        check_kv_cache_dtype(self.model.attention_layers(), self.kv_dtype, self.device)
        if self.kv_dtype.itemsize == 1:
            bind_key_centers(self.model, self.model_config.max_model_len)
        self.weights_bytes = sum(
            t.numel() * t.element_size()
            for t in list(self.model.parameters()) + list(self.model.buffers())
        )

    def capture_graphs(
        self, max_num_seqs: int, max_model_len: int, query_lens: list[int], dtype: torch.dtype
    ) -> list:
        """The head runs eagerly (its input is features as well as ids; the graph runner
        replays models of ids)."""
        return []

    def activation_bytes(self, num_tokens: int) -> int:
        cfg = self.model_config.text_config
        # the fc input (2H) and the embedding rows on top of one decoder layer's activations
        return super().activation_bytes(num_tokens) + num_tokens * 3 * cfg.hidden_size * 4

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> None:
        raise AssertionError("an EAGLE head follows the step through follow(), after sampling")

    def profile(
        self,
        ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
    ) -> None:
        """One forward over a profiling batch (the runner's memory estimate)."""
        self.model(self.target.model.embed_tokens(ids), features, positions, md)

    def follow(self, inputs: EagleInputs, sampled: torch.Tensor | None) -> None:
        """Run the head over the step's rows (writing its KV at the step's slots) once the
        step's tokens exist; keep the rows proposals may start from."""
        next_ids = inputs.next_ids
        if inputs.verify_rows is not None:
            next_ids[inputs.verify_rows] = inputs.verify_tokens.to(next_ids.dtype)
        if inputs.sampled_rows is not None:
            assert sampled is not None, "the step sampled no tokens"
            next_ids[inputs.sampled_rows] = sampled.reshape(-1).to(next_ids.dtype)
        embeds = self.target.model.embed_tokens(next_ids)  # [T, H]
        out = self.model(embeds, inputs.features, inputs.positions, inputs.md)  # [T, H]
        self.kept = out.index_select(0, inputs.keep) if len(inputs.kept) else None
        self.kept_rows = inputs.kept

    def propose(
        self,
        req_ids: list[str],
        positions: list[int],
        table: np.ndarray,
        num_tokens: list[int],
        to_dev: Callable[[np.ndarray], torch.Tensor],
    ) -> list[list[int]]:
        """Greedy drafts, `num_tokens[i]` for row i, after each request's newest token at
        `positions[i]`: the first from the head's row of position - 1 (kept by `follow`),
        the rest by chaining the head on its own f̂ and drafts at positions, positions + 1, ...
        A request the last step did not cover (none in the engine's loop) gets no drafts."""
        drafts: list[list[int]] = [[] for _ in req_ids]
        rows, kept_idx = [], []
        for i, (req_id, p) in enumerate(zip(req_ids, positions, strict=True)):
            entry = self.kept_rows.get(req_id)
            if entry is None or self.kept is None:
                continue
            first, pos0, count = entry
            if 0 <= p - 1 - pos0 < count:
                rows.append(i)
                kept_idx.append(first + p - 1 - pos0)
        if not rows:
            return drafts
        rows_np = np.asarray(rows, dtype=np.int64)
        feats = self.kept[to_dev(np.asarray(kept_idx, dtype=np.int64))]  # [n, H]: f̂_p
        ids = self.target.compute_logits(feats).argmax(dim=-1)  # [n]: the first drafts
        steps: list[tuple[np.ndarray, torch.Tensor]] = [(rows_np, ids)]
        pos = np.asarray(positions, dtype=np.int64)
        want = np.asarray(num_tokens, dtype=np.int64)
        bs = self.block_size
        cur = rows_np
        for step in range(1, int(want[rows_np].max())):
            keep = want[cur] > step
            if not keep.all():
                sel = to_dev(np.flatnonzero(keep))
                cur, ids, feats = cur[keep], ids[sel], feats[sel]
            # entry at position p + step - 1: (f̂ of that position, the draft after it)
            p = pos[cur] + step - 1
            n = len(cur)
            seq_lens = (p + 1).astype(np.int32)
            max_blocks = int(-(-int(seq_lens.max()) // bs))
            sub = np.ascontiguousarray(table[cur, :max_blocks])  # [n, max_blocks]
            slots = sub[np.arange(n), p // bs].astype(np.int64) * bs + p % bs
            qsl = np.arange(n + 1, dtype=np.int32)
            md = AttentionMetadata(
                num_actual_tokens=n,
                query_start_loc=to_dev(qsl),
                seq_lens=to_dev(seq_lens),
                block_tables=to_dev(sub),
                slot_mapping=to_dev(slots),
                max_query_len=1,
                max_seq_len=int(seq_lens.max()),
                query_start_loc_cpu=qsl.tolist(),
                seq_lens_cpu=seq_lens.tolist(),
            )
            embeds = self.target.model.embed_tokens(ids)
            feats = self.model(embeds, feats, to_dev(p), md)  # [n, H]
            ids = self.target.compute_logits(feats).argmax(dim=-1)
            steps.append((cur, ids))
        for step_rows, step_ids in steps:  # one copy to the host per chain step, at the end
            for row, t in zip(step_rows.tolist(), step_ids.tolist(), strict=True):
                drafts[row].append(t)
        return drafts

    def close(self) -> None:
        super().close()
        self.kept, self.kept_rows, self.target = None, {}, None
