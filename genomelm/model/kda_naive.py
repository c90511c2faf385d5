"""Token-by-token reference of the Kimi delta rule (KDA): the readable counterpart of
`kda_chunk.chunk_kda_torch`.

For each token t (per batch row and head), with state S [Dk, Dv]:
    S <- diag(exp(g_t)) S                      (per-channel decay, g_t <= 0 is a log decay)
    S <- S + beta_t k_t (v_t - S^T k_t)^T      (delta rule: move the value stored under k_t towards v_t)
    o_t = S^T (scale * q_t)
q and k are L2-normalised first (`l2_normalise`). Everything runs in fp32 (fp64 for fp64 inputs).

`reference_segment_summary` gives a segment's affine state map S_out = M S_in + S_ext from two runs of this
loop, the readable counterpart of `kda_chunk.kda_segment_summary`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .precision import at_least_fp32

L2_EPS = 1e-6


def l2_normalise(x: Tensor, eps: float = L2_EPS) -> Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last dimension (eps inside the root, as flash-linear-attention)."""
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + eps)


def recurrent_kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The delta rule, one token at a time.

    q, k, g: [B, S, H, Dk]; v: [B, S, H, Dv]; beta: [B, S, H]; initial_state: [B, H, Dk, Dv] or None (zeros).
    Returns output [B, S, H, Dv] in v's dtype and the final state [B, H, Dk, Dv] fp32 (fp64 for fp64 inputs).
    """
    out_dtype = v.dtype
    dtype = at_least_fp32(v.dtype)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    q = l2_normalise(q) * q.shape[-1] ** -0.5
    k = l2_normalise(k)
    batch, seq_len, heads, dk = k.shape
    state = (
        torch.zeros(batch, heads, dk, v.shape[-1], dtype=dtype, device=v.device)
        if initial_state is None
        else initial_state.to(dtype)
    )
    outputs = []
    for t in range(seq_len):
        state = state * g[:, t].exp().unsqueeze(-1)
        stored = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - stored) * beta[:, t].unsqueeze(-1)
        state = state + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    out = torch.stack(outputs, dim=1) if outputs else v.new_zeros(batch, 0, heads, v.shape[-1])
    return out.to(out_dtype), state


def reference_segment_summary(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """A segment's state map packed [M | S_ext] [B, H, Dk, Dk+Dv]: S_out = M S_in + S_ext for every S_in.

    The loop is linear in (state, values) jointly, so M is the final state of a run started from the identity
    with zero values (column i of I is the basis state e_i), and S_ext the final state of a run from zero with
    the segment's values. Inputs as `recurrent_kda`.
    """
    batch, _, heads, dk = k.shape
    dtype = at_least_fp32(v.dtype)
    identity = torch.eye(dk, dtype=dtype, device=k.device).expand(batch, heads, dk, dk)
    _, transition = recurrent_kda(q, k, torch.zeros_like(k, dtype=dtype), g, beta, identity)
    _, from_zero = recurrent_kda(q, k, v, g, beta)
    return torch.cat([transition, from_zero], dim=-1)
