"""Readable dense reference of DSA's sparse attention: an S x S mask built from the selected tokens.

For tests and short sequences only: it materialises [B, S, S] masks and [B, H, S, S] scores and refuses
sequences longer than `forbid_dense_above`. The fast path is `genomelm.model.dsa_sparse` (gathered latents).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class DenseTooLongError(ValueError):
    """A dense S x S reference was asked for a sequence longer than `RunOptions.forbid_dense_above`."""


def check_dense_allowed(seq_len: int, forbid_dense_above: int | None) -> None:
    """Raise DenseTooLongError when an S x S tensor is forbidden at this sequence length."""
    if forbid_dense_above is not None and seq_len > forbid_dense_above:
        raise DenseTooLongError(
            f"dense DSA reference would build a {seq_len} x {seq_len} mask; sequences above "
            f"forbid_dense_above={forbid_dense_above} tokens must use dsa_backend='sparse'"
        )


def selection_mask(token_indices: Tensor, seq_len: int) -> Tensor:
    """[B, n, W] token positions (-1 = empty) -> [B, n, seq_len] bool, True where query s reads key t."""
    valid = token_indices >= 0
    counts = torch.zeros(*token_indices.shape[:2], seq_len, dtype=torch.int32, device=token_indices.device)
    counts.scatter_add_(-1, token_indices.clamp(min=0).long(), valid.to(torch.int32))
    return counts > 0


def dense_dsa_attention(
    q_resid: Tensor,
    latent: Tensor,
    token_indices: Tensor,
    q_b_proj: nn.Linear,
    kv_b_proj: nn.Linear,
    o_proj: nn.Linear,
    num_heads: int,
    nope_dim: int,
    v_dim: int,
    scaling: float,
    forbid_dense_above: int | None,
) -> Tensor:
    """MLA attention restricted to the selected tokens, through a dense mask and an eager softmax.

    q_resid [B, n, q_lora_rank] of n queries, latent [B, S, kv_lora_rank] (after kv_a_layernorm) of the whole
    window, token_indices [B, n, W] (-1 = empty slot) -> [B, n, hidden_size].
    """
    batch, queries, _ = q_resid.shape
    seq_len = latent.shape[1]
    check_dense_allowed(seq_len, forbid_dense_above)
    q = q_b_proj(q_resid).view(batch, queries, num_heads, nope_dim).transpose(1, 2)
    kv = kv_b_proj(latent).view(batch, seq_len, num_heads, nope_dim + v_dim).transpose(1, 2)
    k, v = kv.split([nope_dim, v_dim], dim=-1)
    allowed = selection_mask(token_indices, seq_len)[:, None]  # [B, 1, n, S]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(batch, queries, num_heads * v_dim)
    return o_proj(out)
