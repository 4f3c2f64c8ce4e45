"""Token embedding and the LM head that turns hidden states into vocabulary logits.

The LM head can share its weight with the embedding (`tie_word_embeddings`), in which case the
checkpoint usually has no `lm_head.weight` and the model's loader skips it. Logits are returned
in float32 because the sampler does softmax / penalties on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """Lookup table [vocab, hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype or torch.get_default_dtype()),
            requires_grad=False,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}"


class LMHead(nn.Module):
    """Projection hidden -> vocab; kept unquantized, optionally tied to a `VocabEmbedding`."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tie_to: VocabEmbedding | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tied = tie_to is not None
        if tie_to is not None:
            # Same Parameter object: named_parameters() lists it once, under the embedding.
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(
                torch.empty(vocab_size, hidden_size, dtype=dtype or torch.get_default_dtype()),
                requires_grad=False,
            )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] f32
        return F.linear(hidden, self.weight).float()

    def extra_repr(self) -> str:
        return f"{self.hidden_size} -> {self.vocab_size}, tied={self.tied}"
