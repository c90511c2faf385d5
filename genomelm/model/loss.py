"""Cross-entropy over the vocabulary without ever holding all logits.

`ChunkedLinearCrossEntropy` takes final hidden states and the output head and computes, `chunk_tokens` tokens at
a time, the per-token negative log-likelihood. Its backward recomputes each chunk's logits, so at most one chunk's
[chunk, V] logits exist at once in forward and in backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """nll[t] = logsumexp(h_t W^T) - (h_t W^T)[y_t]; 0 where y_t == IGNORE_INDEX. Logit math in fp32."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int) -> Tensor:
        """hidden [T, D], weight [V, D], labels [T] long -> nll [T] fp32."""
        nll = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        log_norm = torch.empty_like(nll)
        for start in range(0, hidden.shape[0], chunk_tokens):
            stop = start + chunk_tokens
            logits = (hidden[start:stop] @ weight.T).float()
            y = labels[start:stop]
            log_norm[start:stop] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
            nll[start:stop] = torch.where(y == IGNORE_INDEX, 0.0, log_norm[start:stop] - picked)
        ctx.save_for_backward(hidden, weight, labels, log_norm)
        ctx.chunk_tokens = chunk_tokens
        return nll

    @staticmethod
    def backward(ctx: Any, grad_nll: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        hidden, weight, labels, log_norm = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        )
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            stop = start + ctx.chunk_tokens
            h = hidden[start:stop]
            y = labels[start:stop]
            scale = torch.where(y == IGNORE_INDEX, 0.0, grad_nll[start:stop].float())
            # d nll / d logits = softmax - onehot(y), per token times its incoming gradient
            grad_logits = ((h @ weight.T).float() - log_norm[start:stop, None]).exp()
            grad_logits[torch.arange(h.shape[0], device=h.device), y.clamp(min=0)] -= 1.0
            grad_logits *= scale[:, None]
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_logits.to(weight.dtype) @ weight
            if grad_weight is not None:
                grad_weight += grad_logits.T @ h.float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None


def token_nll(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int) -> Tensor:
    """Per-token negative log-likelihood. hidden [..., D], weight [V, D], labels [...] -> [...] fp32 (0 at -100)."""
    if chunk_tokens < 1:
        raise ValueError(f"loss_chunk_tokens must be positive, got {chunk_tokens}")
    flat = ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_tokens
    )
    return flat.view(labels.shape)


def chunked_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int, reduction: str = "mean"
) -> Tensor:
    """Cross-entropy of `hidden @ weight.T` against labels. "mean" over non-ignored tokens (0 if none), "sum",
    or "none" ([...] with 0 at ignored positions)."""
    nll = token_nll(hidden, weight, labels, chunk_tokens)
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    if reduction == "mean":
        return nll.sum() / (labels != IGNORE_INDEX).sum().clamp(min=1)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
