"""The output head and cross-entropy over the vocabulary, without ever holding all logits.

`LMHead` owns the output projection `weight` [V, D] (checkpoint name `lm_head.weight`) and returns per-token
negative log-likelihoods: `ChunkedLinearCrossEntropy` computes them `chunk_tokens` tokens at a time, and its
backward recomputes each chunk's logits, so at most one chunk's [chunk, V] logits exist at once.

Precision: the logits matmul runs in the compute dtype found at the forward (bf16 under bf16 autocast, else
the inputs' dtype), in forward and in backward alike; log-softmax, the picked logit and every gradient of the
logits are fp32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from genomelm.data.vocab import IGNORE_INDEX

from .precision import compute_dtype, fp32_region


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """nll[t] = logsumexp(h_t W^T) - (h_t W^T)[y_t]; 0 where y_t == IGNORE_INDEX."""

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int, dtype: torch.dtype
    ) -> Tensor:
        """hidden [T, D], weight [V, D], labels [T] long, matmul dtype -> nll [T] fp32."""
        nll = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        log_norm = torch.empty_like(nll)
        w = weight.to(dtype)
        with fp32_region(hidden):
            for start in range(0, hidden.shape[0], chunk_tokens):
                stop = start + chunk_tokens
                logits = (hidden[start:stop].to(dtype) @ w.T).float()
                y = labels[start:stop]
                log_norm[start:stop] = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
                nll[start:stop] = torch.where(y == IGNORE_INDEX, 0.0, log_norm[start:stop] - picked)
        ctx.save_for_backward(hidden, weight, labels, log_norm)
        ctx.chunk_tokens, ctx.dtype = chunk_tokens, dtype
        return nll

    @staticmethod
    def backward(ctx: Any, grad_nll: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, labels, log_norm = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        dtype = ctx.dtype
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        )
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            stop = start + ctx.chunk_tokens
            h = hidden[start:stop].to(dtype)
            y = labels[start:stop]
            scale = torch.where(y == IGNORE_INDEX, 0.0, grad_nll[start:stop].float())
            # d nll / d logits = softmax - onehot(y), per token times its incoming gradient
            grad_logits = ((h @ w.T).float() - log_norm[start:stop, None]).exp()
            grad_logits[torch.arange(h.shape[0], device=h.device), y.clamp(min=0)] -= 1.0
            grad_logits *= scale[:, None]
            if grad_hidden is not None:
                grad_hidden[start:stop] = (grad_logits.to(dtype) @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (grad_logits.to(dtype).T @ h).float()
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def token_nll(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int) -> Tensor:
    """Per-token negative log-likelihood: hidden [..., D], weight [V, D], labels [...] -> [...] fp32, 0 where
    labels == IGNORE_INDEX."""
    if chunk_tokens < 1:
        raise ValueError(f"loss_chunk_tokens must be positive, got {chunk_tokens}")
    flat = ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_tokens, compute_dtype(hidden)
    )
    return flat.view(labels.shape)


def reduce_nll(nll: Tensor, labels: Tensor, reduction: str) -> Tensor:
    """Per-token nll [...] (0 at ignored labels) -> "mean" over non-ignored tokens (0 if none), "sum", or
    "none" (unchanged)."""
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    if reduction == "mean":
        return nll.sum() / (labels != IGNORE_INDEX).sum().clamp(min=1)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def chunked_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int, reduction: str = "mean"
) -> Tensor:
    """Cross-entropy of `hidden @ weight.T` against labels, reduced as `reduce_nll`."""
    return reduce_nll(token_nll(hidden, weight, labels, chunk_tokens), labels, reduction)


class LMHead(nn.Module):
    """Output projection onto the vocabulary, used only through the loss: `weight` [V, D]."""

    def __init__(self, hidden_size: int, vocab_size: int, chunk_tokens: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.chunk_tokens = chunk_tokens

    def forward(self, hidden: Tensor, labels: Tensor) -> Tensor:
        """hidden [B, S, D], labels [B, S] -> per-token nll [B, S] fp32 (0 where labels == -100)."""
        return token_nll(hidden, self.weight, labels, self.chunk_tokens)
