"""DSA's sparse attention core: softmax attention over each query's gathered latents, in query blocks.

Each query reads W = index_topk + kpool - 1 token slots of the `Selection` (its selected pools expanded to
tokens plus the incomplete tail pool). The core works in absorbed-latent form: scores are q_lat . latent[slot]
over the kv_lora_rank-wide latent L, and the output is the probability-weighted sum of those latents; the
projections around it (W_uk into the query, W_uv and o_proj after) belong to the layer, `dsa.DSAAttention`.

`sparse_latent_attention` runs queries in blocks: a custom autograd function with a written-out backward
regathers each block, recomputes its probabilities and scatter-adds the gathered latents' gradient into one
[B, S, L] buffer, so the forward + backward working set is bounded by the block ([B, block, W, L]), not by S.

Precision: the queries and the latent come in one dtype (bf16 under bf16 autocast), the matmuls run in it in
forward and backward alike; the softmax is fp32 and the latent's gradient is accumulated in fp32 across query
blocks (both fp64 when the inputs are fp64).

This is the readable reference and the path off CUDA; `dsa_triton` runs the same maths as fused Triton
kernels (`dsa_backend="triton"`, the default on CUDA) and is held to this path by tests/test_kernel_dsa.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from genomelm.model.indexer import Selection
from genomelm.model.precision import at_least_fp32


def gather_indices(selection: Selection, start: int, end: int) -> tuple[Tensor, Tensor]:
    """Slots of queries start..end-1: (token positions clamped to >= 0 [B, b, W] int64,
    valid [B, b, W] bool)."""
    tokens = selection.token_indices(start, end)
    return tokens.clamp(min=0), tokens >= 0


def gather_latents(latent: Tensor, index: Tensor) -> Tensor:
    """latent [B, S, L], index [B, b, W] -> [B, b, W, L]."""
    batch, seq_len, width = latent.shape
    rows = index + (torch.arange(batch, device=latent.device) * seq_len)[:, None, None]
    return latent.reshape(batch * seq_len, width).index_select(0, rows.flatten()).view(*index.shape, width)


def attend_block(q_lat: Tensor, gathered: Tensor, valid: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """Softmax attention of n queries over their own gathered latents (no graph needed).

    q_lat [n, H, L], gathered [n, W, L], valid [n, W] bool, scores times `scaling` -> (out_lat [n, H, L],
    probabilities [n, H, W]), both in q_lat's dtype.
    """
    scores = torch.bmm(q_lat, gathered.transpose(1, 2)).mul_(scaling)
    scores.masked_fill_(~valid[:, None, :], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=at_least_fp32(q_lat.dtype)).to(q_lat.dtype)
    return torch.bmm(probs, gathered), probs


def pool_mass_of(probs: Tensor, pools_per_query: int, kpool: int) -> Tensor:
    """Attention probabilities [..., H, W] -> mass per selected pool summed over heads [..., K] fp32."""
    pooled = probs[..., : pools_per_query * kpool].float().sum(-2)
    return pooled.unflatten(-1, (pools_per_query, kpool)).sum(-1)


def sparse_latent_attention(
    q_lat: Tensor, latent: Tensor, selection: Selection, scaling: float, block: int, want_pool_mass: bool
) -> tuple[Tensor, Tensor | None]:
    """Attention of n queries over their selected slots of a window's latent, `block` queries at a time.

    q_lat [B, n, H, L] (absorbed queries), latent [B, S, L] of the whole window in q_lat's dtype, `selection`
    of the n queries -> (out_lat [B, n, H, L], and when `want_pool_mass` the head-summed attention mass per
    selected pool [B, n, K] fp32, no gradient; else None). Gradients flow to q_lat and latent.
    """
    return _BlockedSparseMLA.apply(selection, scaling, max(1, block), want_pool_mass, q_lat, latent)


class _BlockedSparseMLA(torch.autograd.Function):
    """`sparse_latent_attention` with a written-out backward.

    Forward runs `attend_block` block by block; backward regathers and recomputes each block's probabilities,
    then with g = d out_lat: d probs = g G^T, d scores = softmax backward, d q_lat = scale * d scores G, and
    d G = probs^T g + scale * d scores^T q_lat (one matmul), scatter-added (index_add_) into one [B*S, L]
    buffer. Empty slots have probability 0 and so add nothing.
    """

    @staticmethod
    def forward(
        ctx: Any,
        selection: Selection,
        scaling: float,
        block: int,
        want_pool_mass: bool,
        q_lat: Tensor,
        latent: Tensor,
    ) -> tuple[Tensor, Tensor | None]:
        batch, seq_len, heads, width = q_lat.shape
        pools_per_query = selection.pools.shape[-1]
        out_lat = torch.empty_like(q_lat)
        pool_mass = (
            q_lat.new_empty(batch, seq_len, pools_per_query, dtype=torch.float32) if want_pool_mass else None
        )
        for start in range(0, seq_len, block):
            end = min(start + block, seq_len)
            index, valid = gather_indices(selection, start, end)
            out_block, probs = attend_block(
                q_lat[:, start:end].flatten(0, 1),
                gather_latents(latent, index).view(-1, index.shape[-1], width),
                valid.flatten(0, 1),
                scaling,
            )
            out_lat[:, start:end] = out_block.view(batch, end - start, heads, width)
            if pool_mass is not None:
                mass = pool_mass_of(probs, pools_per_query, selection.kpool)
                pool_mass[:, start:end] = mass.view(batch, end - start, pools_per_query)
        ctx.selection, ctx.scaling, ctx.block = selection, scaling, block
        ctx.save_for_backward(q_lat, latent)
        if pool_mass is not None:
            ctx.mark_non_differentiable(pool_mass)
        return out_lat, pool_mass

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, _grad_pool_mass: Tensor | None) -> tuple[Tensor | None, ...]:
        q_lat, latent = ctx.saved_tensors
        selection, scaling, block = ctx.selection, ctx.scaling, ctx.block
        batch, seq_len, heads, width = q_lat.shape
        keys = latent.shape[1]
        grad_out = grad_out.contiguous()
        grad_q_lat = torch.empty_like(q_lat)
        wide = at_least_fp32(latent.dtype)
        grad_latent = torch.zeros(batch * keys, width, dtype=wide, device=latent.device)
        row_offset = (torch.arange(batch, device=latent.device) * keys)[:, None, None]
        for start in range(0, seq_len, block):
            end = min(start + block, seq_len)
            index, valid = gather_indices(selection, start, end)
            slots = index.shape[-1]
            gathered = gather_latents(latent, index).view(-1, slots, width)  # [n, W, L]
            q_block = q_lat[:, start:end].flatten(0, 1)  # [n, H, L]
            _, probs = attend_block(q_block, gathered, valid.flatten(0, 1), scaling)
            g = grad_out[:, start:end].flatten(0, 1)  # [n, H, L]
            grad_probs = torch.bmm(g, gathered.transpose(1, 2)).to(wide)
            probs_wide = probs.to(wide)
            grad_scores = probs_wide * (grad_probs - (grad_probs * probs_wide).sum(-1, keepdim=True))
            grad_scores = grad_scores.mul_(scaling).to(q_block.dtype)
            grad_q_lat[:, start:end] = torch.bmm(grad_scores, gathered).view(batch, end - start, heads, width)
            grad_gathered = torch.bmm(
                torch.cat([probs, grad_scores], dim=1).transpose(1, 2), torch.cat([g, q_block], dim=1)
            )  # [n, W, L]
            grad_latent.index_add_(0, (index + row_offset).flatten(), grad_gathered.flatten(0, 1).to(wide))
        return None, None, None, None, grad_q_lat, grad_latent.to(latent.dtype).view(batch, keys, width)


def query_positions(selection: Selection, device: torch.device) -> Tensor:
    """The selection's queries' global positions [n] int64 on `device` (0..n-1 when it has none)."""
    if selection.positions is None:
        return torch.arange(selection.pools.shape[1], device=device)
    return selection.positions.to(device=device, dtype=torch.int64)
