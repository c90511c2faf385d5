"""Kimi delta attention (KDA), the linear-attention layer of GLM-5.3-Flash.

Layer: q/k/v projections -> causal depthwise conv (width K) + SiLU -> per-channel decay gate (low rank, with a
lower bound) and beta -> delta rule over the sequence -> sigmoid-gated RMS norm per head -> output projection.

The delta rule runs in one of three backends behind `kda_core`:
- "fla": flash-linear-attention's `chunk_kda` (CUDA only, when the package is installed);
- "torch": `chunk_kda_torch`, the chunked (WY) form in vectorised fp32 torch, O(S) memory;
- "recurrent": `kda_naive.recurrent_kda`, the token loop (reference, slow).
"auto" picks "fla" on CUDA when importable, else "torch". `KDAState` carries the recurrent state and the conv
tail so that a sequence processed in pieces equals the whole.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig, RunOptions
from .kda_naive import l2_normalise, recurrent_kda
from .norms import GatedRMSNorm
from .precision import fp32_region

KDA_BACKENDS = ("auto", "fla", "torch", "recurrent")
SUB_CHUNK = 16  # rows of a chunk sharing one decay reference point in the intra-chunk scores
SAFE_EXPONENT = 80.0  # largest |log decay| summed over a sub-chunk that exp() may see (fp32 overflows at ~88)
NEGLIGIBLE_EXPONENT = -30.0  # log decays below this count as exact zeros (see `_decay`)
NEGLIGIBLE_DECAY = math.exp(NEGLIGIBLE_EXPONENT)


class KDAState(NamedTuple):
    """What a KDA layer hands to the next piece of the same sequence."""

    recurrent: Tensor  # [B, H, Dk, Dv] fp32
    conv_tail: Tensor  # [B, 3*H*Dk, K-1], the last K-1 conv inputs (zeros before the sequence starts)


@functools.cache
def fla_chunk_kda() -> Callable[..., tuple[Tensor, Tensor]] | None:
    """flash-linear-attention's `chunk_kda`, or None when the package (or its KDA op) is not installed."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda


def select_kda_backend(requested: str, device_type: str, fla_available: bool) -> str:
    """Resolve `RunOptions.kda_backend` for a device: "auto" -> "fla" on CUDA, "torch" elsewhere.

    On CUDA "auto" without fla-core is an error rather than a silent fall back: the torch path loops over the
    chunks in Python and solves in fp64, far too slow for a GPU run (ask for kda_backend=torch to accept it).
    """
    if requested not in KDA_BACKENDS:
        raise ValueError(f"kda_backend must be one of {KDA_BACKENDS}, got {requested!r}")
    if requested == "auto":
        if device_type != "cuda":
            return "torch"
        if not fla_available:
            raise RuntimeError(
                "KDA on CUDA needs flash-linear-attention's chunk_kda, which is not installed: "
                "pip install -e '.[gpu]' (fla-core), or set kda_backend=torch to run the slow torch path"
            )
        return "fla"
    if requested == "fla" and not (device_type == "cuda" and fla_available):
        raise RuntimeError(
            f"kda_backend 'fla' needs CUDA and flash-linear-attention (pip install fla-core); "
            f"device is {device_type!r}, fla {'installed' if fla_available else 'not installed'}"
        )
    return requested


def _decay(exponent: Tensor) -> Tensor:
    """exp() of log decays (<= 0 where used), with exponents below NEGLIGIBLE_EXPONENT giving exactly 0.

    A decay under exp(-30) ~ 1e-13 changes no fp32 result of order one, while the fp32 subnormals that exp() and
    products of such factors produce otherwise make CPU arithmetic ~100x slower (no flush-to-zero by default).
    """
    return F.threshold(exponent, NEGLIGIBLE_EXPONENT, float("-inf")).exp()


def _intra_chunk_scores(
    xs: tuple[Tensor, ...], k: Tensor, cum_g: Tensor, exact_diagonal: bool
) -> list[Tensor]:
    """Decayed scores inside each chunk, for each x in xs: out[i, j] = sum_d x_i[d] k_j[d] exp(G_i[d] - G_j[d])
    for j <= i, else 0.

    x, k, cum_g: [..., C, D] (cum_g = cumulative log decay within the chunk, non-increasing). Rows are split in
    sub-chunks a of SUB_CHUNK rows, each with G at its first row, r_a, as reference: out[i, j] is
    (x_i exp(G_i - G_r)) . (k_j exp(G_r - G_j)). For the columns before r_a (only the sub-blocks below the
    diagonal are built) both factors are <= 1 and may be cut to 0 below exp(NEGLIGIBLE_EXPONENT) (`_decay`), so
    their products stay clear of fp32 subnormals. Inside the diagonal sub-block exp(G_r - G_j) may grow up to the
    decay over a sub-chunk: fine when the gate's lower bound keeps it below SAFE_EXPONENT, otherwise
    (`exact_diagonal`) the diagonal sub-blocks are computed pairwise. Returns one [..., C, C] fp32 tensor per x.
    """
    c = k.shape[-2]
    s = SUB_CHUNK
    n_sub = c // s
    g_sub = cum_g.unflatten(-2, (n_sub, s))  # [..., n_sub, s, D]
    g_ref = g_sub[..., :1, :]  # [..., n_sub, 1, D]
    k_sub = k.unflatten(-2, (n_sub, s))
    row_exponent = g_sub - g_ref  # <= 0
    causal = torch.ones(s, s, dtype=torch.bool, device=k.device).tril()
    if exact_diagonal:
        pair_decay = _decay(
            (g_sub.unsqueeze(-2) - g_sub.unsqueeze(-3)).masked_fill(~causal[:, :, None], float("-inf"))
        )  # [..., n_sub, s, s, D]
        k_pair = k_sub.unsqueeze(-3) * pair_decay
    else:
        row_decay = row_exponent.exp()  # >= exp(-SAFE_EXPONENT): no subnormals
        k_diag = (k_sub * (-row_exponent).exp()).transpose(-1, -2)  # [..., n_sub, D, s]
    row_cut = _decay(row_exponent) if n_sub > 1 else None
    # k_j exp(G_ra - G_j) for the columns j before each sub-chunk a > 0: [..., D, a*s]
    k_before = [
        (k[..., : a * s, :] * _decay(g_ref[..., a, :, :] - cum_g[..., : a * s, :])).transpose(-1, -2)
        for a in range(1, n_sub)
    ]
    out = []
    for x in xs:
        x_sub = x.unflatten(-2, (n_sub, s))
        if exact_diagonal:
            diag = (x_sub.unsqueeze(-2) * k_pair).sum(-1)
        else:
            diag = ((x_sub * row_decay) @ k_diag).masked_fill(~causal, 0.0)  # [..., n_sub, s, s]
        rows = []
        for a in range(n_sub):
            parts = [] if a == 0 else [(x_sub[..., a, :, :] * row_cut[..., a, :, :]) @ k_before[a - 1]]
            parts.append(diag[..., a, :, :])
            if a < n_sub - 1:
                parts.append(x.new_zeros(*x.shape[:-2], s, c - (a + 1) * s))
            rows.append(torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0])
        out.append(torch.cat(rows, dim=-2))
    return out


class _UnitLowerSolve(torch.autograd.Function):
    """x = (I + tril(a, -1))^-1 b over the last two dims (a's diagonal and upper triangle are not read).

    The forward solves in fp64: w's rows shrink like exp(G) and would turn into fp32 subnormals inside the solve
    (an order of magnitude slower on CPU); results under NEGLIGIBLE_DECAY are cut to 0 on the way back. The
    backward sees O(1) gradients and stays in fp32: grad_b = (I + A)^-T grad_x, grad_a = -tril(grad_b x^T, -1).
    """

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:  # type: ignore[override]
        x = torch.linalg.solve_triangular(a.double(), b.double(), upper=False, unitriangular=True)
        x = x.masked_fill_(x.abs() < NEGLIGIBLE_DECAY, 0.0).to(b.dtype)
        ctx.save_for_backward(a, x)
        return x

    @staticmethod
    def backward(ctx, grad_x: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        a, x = ctx.saved_tensors
        grad_b = torch.linalg.solve_triangular(a.mT, grad_x, upper=True, unitriangular=True)
        grad_a = (grad_b @ x.mT).tril_(-1).neg_()
        return grad_a, grad_b


def chunk_kda_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
    gate_bound: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunked delta rule, same contract as `kda_naive.recurrent_kda` (q, k normalised inside, fp32 math).

    q, k, g: [B, S, H, Dk]; v: [B, S, H, Dv]; beta: [B, S, H]; initial_state [B, H, Dk, Dv] or None.
    `gate_bound`: a bound on |g| per token (the gate's lower bound) if known; it lets the diagonal sub-blocks use
    the factorised form. Inside a chunk the WY form replaces the token loop: with A = strict-lower
    beta_i k_i.k_j exp(G_i - G_j), u = (I + A)^-1 (beta v) and w = (I + A)^-1 (beta k exp(G)); the chunk loop then
    carries the state: v' = u - w S, o = (q exp(G)) S + tril(q_i.k_j exp(G_i - G_j)) v',
    S <- exp(G_last) S + (k exp(G_last - G))^T v'. Returns output [B, S, H, Dv] (v's dtype), state fp32.
    Decays under exp(NEGLIGIBLE_EXPONENT) count as 0 (`_decay`), keeping the fp32 math clear of subnormals.
    """
    if chunk_size % SUB_CHUNK:
        raise ValueError(f"kda chunk_size must be a multiple of {SUB_CHUNK}, got {chunk_size}")
    out_dtype = v.dtype
    batch, seq_len, heads, dk = k.shape
    dv = v.shape[-1]
    pad = (-seq_len) % chunk_size

    def chunked(t: Tensor) -> Tensor:  # [B, S, H, *] -> [B, H, N, C, *] fp32, zero padded
        t = t.float().transpose(1, 2)
        t = F.pad(t, (0, 0, 0, pad)) if t.dim() == 4 else F.pad(t, (0, pad))
        return t.unflatten(2, (-1, chunk_size))

    q = chunked(l2_normalise(q.float()) * dk**-0.5)
    k = chunked(l2_normalise(k.float()))
    v, g, beta = chunked(v), chunked(g), chunked(beta).unsqueeze(-1)
    cum_g = g.cumsum(-2)  # [B, H, N, C, Dk]
    exact_diagonal = gate_bound is None or gate_bound * (SUB_CHUNK - 1) > SAFE_EXPONENT
    a_kk, a_qk = _intra_chunk_scores((k * beta, q), k, cum_g, exact_diagonal)  # a_kk's diagonal is not used
    decay_in = _decay(cum_g)  # exp(G)
    rhs = torch.cat([v * beta, k * beta * decay_in], dim=-1)
    u, w = _UnitLowerSolve.apply(a_kk, rhs).split([dv, dk], dim=-1)
    g_last = cum_g[..., -1:, :]  # [B, H, N, 1, Dk]
    q_decayed = q * decay_in
    k_to_end = k * _decay(g_last - cum_g)
    chunk_decay = _decay(g_last.squeeze(-2)).unsqueeze(-1)  # [B, H, N, Dk, 1]

    # the state recurrence runs on [B*H, ...] views: two fused multiply-adds per chunk; the outputs are batched
    # matmuls after the loop, from the states entering each chunk and the corrected values v'
    state = (
        torch.zeros(batch * heads, dk, dv, dtype=torch.float32, device=v.device)
        if initial_state is None
        else initial_state.float().flatten(0, 1)
    )
    states, v_news = [], []
    # unbind once: indexing chunk n inside the loop would cost a full-size gradient buffer per chunk in backward
    per_chunk = zip(*(t.flatten(0, 1).unbind(1) for t in (u, w, chunk_decay, k_to_end.transpose(-1, -2))))
    for u_n, w_n, decay_n, k_n in per_chunk:
        states.append(state)
        v_new = torch.baddbmm(u_n, w_n, state, alpha=-1.0)  # u - w S
        v_news.append(v_new)
        state = torch.baddbmm(state * decay_n, k_n, v_new)
    entering = torch.stack(states, dim=1).unflatten(0, (batch, heads))  # [B, H, N, Dk, Dv]
    v_new = torch.stack(v_news, dim=1).unflatten(0, (batch, heads))  # [B, H, N, C, Dv]
    out = torch.baddbmm(
        (q_decayed @ entering).flatten(0, 2), a_qk.flatten(0, 2), v_new.flatten(0, 2)
    ).unflatten(0, (batch, heads, -1))
    out = out.flatten(2, 3)[:, :, :seq_len]
    state = state.unflatten(0, (batch, heads))
    return out.transpose(1, 2).to(out_dtype), state


def kda_core(
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    chunk_size: int,
    gate_bound: float | None,
) -> tuple[Tensor, Tensor]:
    """The delta rule in a resolved backend ("fla", "torch", "recurrent"). Shapes as `chunk_kda_torch`.

    The torch and recurrent paths run in fp32 with autocast off (autocast would otherwise run their matmuls,
    and so the carried state, in bf16); fla's kernel takes bf16 q/k/v and keeps its state in fp32 itself.
    """
    if backend == "fla":
        chunk_kda = fla_chunk_kda()
        assert chunk_kda is not None, "select_kda_backend returns 'fla' only when it is installed"
        out, state = chunk_kda(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=initial_state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        return out, state.float()
    with fp32_region(q):
        if backend == "recurrent":
            return recurrent_kda(q, k, v, g, beta, initial_state)
        return chunk_kda_torch(q, k, v, g, beta, initial_state, chunk_size, gate_bound)


def causal_depthwise_conv(padded: Tensor, weight: Tensor) -> Tensor:
    """Depthwise causal conv, channels last: padded [B, K-1+S, C] (K-1 earlier inputs first), weight [C, 1, K]
    -> [B, S, C] with out[t, c] = sum_j weight[c, 0, j] * padded[t + j, c] (`nn.Conv1d(groups=C)` without its
    [B, C, S] transposes: K multiply-adds over contiguous rows)."""
    kernel = weight.shape[-1]
    steps = padded.shape[1] - kernel + 1
    taps = weight[:, 0].T  # [K, C]
    out = padded[:, :steps] * taps[0]
    for j in range(1, kernel):
        out = out.addcmul(padded[:, j : j + steps], taps[j])
    return out


class ForgetGate(nn.Module):
    """Per-channel log decay g <= 0 from a low-rank projection. `dt_bias` [H*Dk] and `A_log` [H] are fp32.

    With a lower bound b: g = b * sigmoid(exp(A_log) * (f + dt_bias)), so b < g < 0; without:
    g = -exp(A_log) * softplus(f + dt_bias).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.linear_num_heads
        self.head_dim = config.linear_head_dim
        self.lower_bound = config.linear_lower_bound
        self.f_a_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, self.num_heads * self.head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads * self.head_dim, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, S, D] -> g [B, S, H, Dk] fp32."""
        f = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).unflatten(
            -1, (self.num_heads, -1)
        )
        rate = self.A_log.float().exp().view(self.num_heads, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * f)
        return -rate * F.softplus(f, threshold=20.0)


class KDAttention(nn.Module):
    """KDA layer. Parameter names follow transformers' `Glm5NextTextLinearAttention`."""

    def __init__(self, config: ModelConfig, layer_idx: int, options: RunOptions) -> None:
        super().__init__()
        if options.kda_backend not in KDA_BACKENDS:
            raise ValueError(f"kda_backend must be one of {KDA_BACKENDS}, got {options.kda_backend!r}")
        self.layer_idx = layer_idx
        self.num_heads = config.linear_num_heads
        self.head_dim = config.linear_head_dim
        self.kernel = config.linear_conv_kernel_dim
        width = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.conv1d = nn.Conv1d(
            3 * width, 3 * width, self.kernel, groups=3 * width, bias=False, padding=0, dtype=torch.float32
        )
        self.forget_gate = ForgetGate(config)
        self.b_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.o_norm = GatedRMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.requested_backend = options.kda_backend
        self.chunk_size = options.kda_chunk_size
        self.gate_bound = None if config.linear_lower_bound is None else abs(config.linear_lower_bound)
        self.backend: str | None = None  # resolved at the first forward, on the input's device
        self.path = f"kda: {options.kda_backend} (resolved at the first forward)"

    def resolve_backend(self, device: torch.device) -> str:
        if self.backend is None:
            self.backend = select_kda_backend(
                self.requested_backend, device.type, fla_chunk_kda() is not None
            )
            self.path = {
                "fla": "kda: fla chunk_kda (cuda)",
                "torch": f"kda: torch chunked (chunk {self.chunk_size})",
                "recurrent": "kda: recurrent token loop (reference)",
            }[self.backend]
        return self.backend

    def initial_state(self, batch: int, dtype: torch.dtype, device: torch.device) -> KDAState:
        """Zero state: what a sequence starts from."""
        width = self.num_heads * self.head_dim
        return KDAState(
            torch.zeros(
                batch, self.num_heads, self.head_dim, self.head_dim, dtype=torch.float32, device=device
            ),
            torch.zeros(batch, 3 * width, self.kernel - 1, dtype=dtype, device=device),
        )

    def forward(self, x: Tensor, state: KDAState | None = None) -> tuple[Tensor, KDAState]:
        """x: [B, S, D] -> (y [B, S, D], state after the last token)."""
        backend = self.resolve_backend(x.device)
        if state is None:
            state = self.initial_state(x.shape[0], x.dtype, x.device)
        qkv_weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        mixed = F.linear(x, qkv_weight)  # [B, S, 3W]
        padded = torch.cat([state.conv_tail.transpose(1, 2).to(mixed.dtype), mixed], dim=1)  # [B, K-1+S, 3W]
        conv_tail = padded[:, padded.shape[1] - (self.kernel - 1) :].transpose(1, 2)
        conv = F.silu(causal_depthwise_conv(padded.to(self.conv1d.weight.dtype), self.conv1d.weight)).to(
            x.dtype
        )
        q, k, v = conv.unflatten(-1, (3 * self.num_heads, self.head_dim)).chunk(3, dim=2)
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.b_proj(x))
        core, recurrent = kda_core(
            backend, q, k, v, g, beta, state.recurrent, self.chunk_size, self.gate_bound
        )
        gate = self.g_b_proj(self.g_a_proj(x)).unflatten(-1, (self.num_heads, self.head_dim))
        out = self.o_norm(core, gate).flatten(2)
        return self.o_proj(out), KDAState(recurrent, conv_tail)
