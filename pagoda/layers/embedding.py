"""Token embedding and the LM head that turns hidden states into vocabulary logits.

The LM head can share its weight with the embedding (`tie_word_embeddings`), in which case the
checkpoint usually has no `lm_head.weight` and the model's loader skips it. An untied head may
instead run a quantized `LinearMethod` (a checkpoint whose quantization_config covers lm_head):
its parameters (`weight_packed`, `weight_scale`, ...) then sit on the head itself, so they load
under the checkpoint's `lm_head.*` names. Logits are returned in float32 because the sampler
does softmax / penalties on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.linear import LinearMethod, UnquantizedLinearMethod, dense_gemv_kernel


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
    """Projection hidden -> vocab: dense (optionally tied to a `VocabEmbedding`) or quantized.

    `linear_method`: None or `UnquantizedLinearMethod` keeps the dense `weight`; a quantized
    method (`WNA16LinearMethod`) creates its checkpoint parameters on this module, which then
    carries the attributes a method reads from its layer (`in_features`, `out_features`,
    `params_dtype`, `prefix`, ...). The model loader runs `linear_method`'s
    `init_dummy_weights` / `process_weights_after_loading` on it as on the linear layers.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tie_to: VocabEmbedding | None = None,
        dtype: torch.dtype | None = None,
        linear_method: LinearMethod | None = None,
        prefix: str = "lm_head",
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tied = tie_to is not None
        if isinstance(linear_method, UnquantizedLinearMethod):
            linear_method = None
        # None: the dense weight below; else the quantized method that owns the parameters.
        self.linear_method = linear_method
        if linear_method is not None:
            if tie_to is not None:
                raise ValueError(f"{prefix}: a head tied to the embedding cannot be quantized")
            self.in_features = hidden_size
            self.out_features = vocab_size
            self.out_features_per_shard = [vocab_size]
            self.prefix = prefix
            self.params_dtype = dtype or torch.get_default_dtype()
            linear_method.create_weights(self, hidden_size, [vocab_size], self.params_dtype)
        elif tie_to is not None:
            # Same Parameter object: named_parameters() lists it once, under the embedding.
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(
                torch.empty(vocab_size, hidden_size, dtype=dtype or torch.get_default_dtype()),
                requires_grad=False,
            )

    @property
    def quantized(self) -> bool:
        return self.linear_method is not None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] f32
        if self.linear_method is None:
            w = self.weight
            if hidden.is_cuda and hidden.dim() == 2 and hidden.shape[0] == 1:
                # Batch-1 decode: pagoda's GEMV (H200: ~5 % faster than cuBLAS on wide
                # layers) writes the float32 logits directly, rounded to the model dtype first
                # exactly as `F.linear(...).float()` would be, so greedy picks do not change.
                gemv = dense_gemv_kernel(hidden.device)
                if (
                    gemv is not None
                    and w.dtype in (torch.bfloat16, torch.float16)
                    and hidden.dtype == w.dtype
                ):
                    workspace = getattr(self, "split_k_workspace", None)
                    return gemv.gemv_bf16(
                        hidden, w, None, out_dtype=torch.float32, workspace=workspace
                    )
            return F.linear(hidden, w).float()
        return self.linear_method.apply(self, hidden, None).float()

    def extra_repr(self) -> str:
        method = f", method={type(self.linear_method).__name__}" if self.quantized else ""
        return f"{self.hidden_size} -> {self.vocab_size}, tied={self.tied}{method}"
