"""Per-token Hessian weights from the float model's next-token loss (GuidedQuant-like).

GPTQ minimises Σ_t ||ΔW x_t||² over the calibration tokens, every token alike. How much a
linear's output error at token t moves the model's loss is, to first order, dL/dy_t · Δy_t;
with the error spread evenly over the output channels its square averages ||dL/dy_t||² ||Δy_t||²
/ d_out. Weighting token t's term by w_t = ||dL/dy_t||² (normalised to mean 1 per linear) turns
H = 2 X Xᵀ / N into 2 Σ_t w_t x_t x_tᵀ / N. Per-output-channel weights would not change GPTQ's
solution (rows are independent given H); per-token weights do.

The gradients come from one backward pass of the float (transformers) model per calibration
sample, with respect to the activations only (no weight gradients). The results are
preallocated before the first pass: a few small tensors kept from each pass, allocated among its
large transient ones, fragmented the CPU heap so that resident memory grew by ~0.16 GiB a sample
on Qwen2.5-0.5B (5.6 GiB after 12 samples, 3.9 flat with the buffers allocated up front).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def loss_gradient_token_weights(
    model: nn.Module,  # a transformers causal LM, float weights
    samples: list[torch.Tensor],  # each [T] token ids
    names: list[str] | None = None,  # nn.Linear module names to watch (default: every one)
) -> dict[str, list[torch.Tensor]]:
    """For each watched linear: per sample, ||dL/dy_t||² at every token t [T] (float32),
    L the summed next-token cross-entropy of the sample (not normalised: a fused linear's
    weights are the sum of its parts', see `fused_token_weights`)."""
    if names is None:
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        names = [n for n in names if n != "lm_head"]
    modules = dict(model.named_modules())
    out: dict[str, list[torch.Tensor]] = {
        n: [torch.ones(ids.numel()) for ids in samples] for n in names
    }
    current = [0]  # the sample being differentiated
    seen: set[str] = set()

    def forward_hook(name: str):
        def hook(_m: nn.Module, _inp: Any, y: torch.Tensor) -> None:
            def grad_hook(g: torch.Tensor) -> None:
                out[name][current[0]].copy_(g.detach().float().pow(2).sum(-1).reshape(-1))
                seen.add(name)

            if y.requires_grad:
                y.register_hook(grad_hook)

        return hook

    handles = [modules[n].register_forward_hook(forward_hook(n)) for n in names]
    grad_flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    embed = model.get_input_embeddings()
    device = embed.weight.device
    try:
        for i, ids in enumerate(samples):
            ids = ids.to(device).reshape(1, -1)
            if ids.shape[1] < 2:
                continue  # no next-token loss: weights of 1
            current[0] = i
            x = embed(ids).detach().requires_grad_(True)
            logits = model(inputs_embeds=x, use_cache=False).logits[0, :-1].float()
            loss = nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
            seen.clear()
            loss.backward()
            missing = [n for n in names if n not in seen]
            if missing:
                raise RuntimeError(f"no loss gradient reached {', '.join(missing[:3])}")
    finally:
        for h in handles:
            h.remove()
        for p, flag in zip(model.parameters(), grad_flags):
            p.requires_grad_(flag)
    return out


def fused_token_weights(
    weights: dict[str, list[torch.Tensor]], names: list[str]
) -> list[torch.Tensor]:
    """The per-sample token weights of one (possibly fused) linear whose output shards are the
    modules `names` (||dL/dy||² adds over the shards), normalised to mean 1 over all tokens."""
    missing = [n for n in names if n not in weights]
    if missing:
        raise KeyError(f"no loss-gradient token weights for {', '.join(missing)}")
    total = [sum(parts) for parts in zip(*(weights[n] for n in names), strict=True)]
    mean = torch.cat(total).mean().clamp_min(1e-30)
    return [w / mean for w in total]


def hf_token_weights(
    model_path: str,
    gguf_file: str | None,
    samples: list[torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, list[torch.Tensor]]:
    """`loss_gradient_token_weights` of the checkpoint at `model_path` (HF directory, or the
    directory of `gguf_file`), loaded whole with transformers in `dtype` on `device`."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).to(device).eval()
    try:
        return loss_gradient_token_weights(model, samples)
    finally:
        del model
