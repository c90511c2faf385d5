"""The Kimi delta rule (KDA's sequence mixing) in chunked form, and the choice of the backend that runs it.

`kda_core` runs the delta rule in one of three backends:
- "fla": flash-linear-attention's `chunk_kda` (CUDA only, when the package is installed), fed q/k/v/beta in
  the compute dtype (bf16 under autocast) and the state in fp32 (`fla_kda`), optionally with its in-kernel
  gate (`FlaGate`);
- "torch": `chunk_kda_torch`, the chunked (WY) form in vectorised fp32 torch, O(S) memory;
- "recurrent": `kda_naive.recurrent_kda`, the token loop (reference, slow).
`select_kda_backend` resolves "auto": "fla" on CUDA, "torch" elsewhere.

The delta rule is affine in its incoming state: a segment maps S_in to S_out = M S_in + S_ext.
`kda_segment_summary` gives [M | S_ext] from the same chunk transforms (`kda_chunk_transforms`) that the
output path (`kda_chunk_outputs`) uses, so a segment can be summarised before its incoming state is known
(context parallelism, `genomelm.parallel`); on fla the same summary is one `chunk_kda` call on packed values
(`fla_segment_summary`), with no fp64 solve.

Math runs in fp32, or in fp64 for fp64 inputs (`precision.at_least_fp32`). The layer around it (projections,
short conv, gates, output norm) is `kda.KDAttention`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .backends import kernels_traced
from .kda_naive import l2_normalise, recurrent_kda
from .precision import at_least_fp32, compute_dtype, fp32_region

KDA_BACKENDS = ("auto", "fla", "torch", "recurrent")
SUB_CHUNK = 16  # rows of a chunk sharing one decay reference point in the intra-chunk scores
SAFE_EXPONENT = 80.0  # largest |log decay| summed over a sub-chunk that exp() may see (fp32 overflows at ~88)
NEGLIGIBLE_EXPONENT = -30.0  # log decays below this count as exact zeros (see `_decay`)
NEGLIGIBLE_DECAY = math.exp(NEGLIGIBLE_EXPONENT)


@functools.cache
def fla_chunk_kda() -> Callable[..., tuple[Tensor, Tensor]] | None:
    """flash-linear-attention's `chunk_kda`, or None when the package (or its KDA op) is not installed."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda


@functools.cache
def fla_causal_conv1d() -> Callable[..., tuple[Tensor, Tensor | None]] | None:
    """flash-linear-attention's `causal_conv1d`, or None when the package is not installed."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        return None
    return causal_conv1d


def select_kda_backend(requested: str, device_type: str, fla_available: bool) -> str:
    """Resolve `RunOptions.kda_backend` for a device: "auto" -> "fla" on CUDA, "torch" elsewhere. "fla" is
    also taken on another device inside `backends.tracing_kernels` (a trace on fake tensors, with fla's
    stand-ins).

    On CUDA "auto" without fla-core is an error rather than a silent fall back: the torch backend loops over
    the chunks in Python and solves in fp64, far too slow for a GPU run (kda_backend=torch accepts that).
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
    if requested == "fla" and not ((device_type == "cuda" or kernels_traced()) and fla_available):
        raise RuntimeError(
            f"kda_backend 'fla' needs CUDA and flash-linear-attention (pip install fla-core); "
            f"device is {device_type!r}, fla {'installed' if fla_available else 'not installed'}"
        )
    return requested


def _decay(exponent: Tensor) -> Tensor:
    """exp() of log decays (<= 0 where used), with exponents below NEGLIGIBLE_EXPONENT giving exactly 0.

    A decay under exp(-30) ~ 1e-13 changes no fp32 result of order one, while the fp32 subnormals that exp()
    and products of such factors would produce make CPU arithmetic ~100x slower (no flush-to-zero by default).
    """
    return F.threshold(exponent, NEGLIGIBLE_EXPONENT, float("-inf")).exp()


def _intra_chunk_scores(
    xs: tuple[Tensor, ...], k: Tensor, cum_g: Tensor, exact_diagonal: bool
) -> list[Tensor]:
    """Decayed scores inside each chunk, for each x in xs:
    out[i, j] = sum_d x_i[d] k_j[d] exp(G_i[d] - G_j[d]) for j <= i, else 0.

    x, k, cum_g: [..., C, D] (cum_g = cumulative log decay within the chunk, non-increasing). Rows are split
    in sub-chunks a of SUB_CHUNK rows, each with G at its first row, r_a, as reference: out[i, j] is
    (x_i exp(G_i - G_r)) . (k_j exp(G_r - G_j)). For the columns before r_a (only the sub-blocks below the
    diagonal are built) both factors are <= 1 and may be cut to 0 below exp(NEGLIGIBLE_EXPONENT) (`_decay`),
    so their products stay clear of fp32 subnormals. Inside the diagonal sub-block exp(G_r - G_j) may grow up
    to the decay over a sub-chunk: fine when the gate's lower bound keeps it below SAFE_EXPONENT, otherwise
    (`exact_diagonal`) the diagonal sub-blocks are computed pairwise. Returns one [..., C, C] tensor per x, in
    the inputs' dtype (fp32, or fp64).
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

    The forward solves in fp64: w's rows shrink like exp(G) and would turn into fp32 subnormals inside the
    solve (an order of magnitude slower on CPU); results under NEGLIGIBLE_DECAY are cut to 0 on the way back.
    The backward sees O(1) gradients and stays in the inputs' dtype (fp32, or fp64):
    grad_b = (I + A)^-T grad_x, grad_a = -tril(grad_b x^T, -1).
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


class ChunkTransforms(NamedTuple):
    """A sequence's chunk-local quantities of the chunked delta rule (`kda_chunk_transforms`).

    Tensors are [B, H, N, ...] in fp32 (fp64 for fp64 inputs), for N chunks of C tokens (the last one zero
    padded: a padded token is an identity step). With S the state entering chunk n, the chunk's corrected
    values are u - w S and the state after it is diag(chunk_decay) S + k_to_end^T (u - w S).
    """

    u: Tensor  # [B, H, N, C, Dv] (I + A)^-1 (beta v)
    w: Tensor  # [B, H, N, C, Dk] (I + A)^-1 (beta k exp(G))
    k_to_end: Tensor  # [B, H, N, C, Dk] k exp(G_last - G)
    chunk_decay: Tensor  # [B, H, N, Dk] exp(G_last)
    q_decayed: Tensor | None  # [B, H, N, C, Dk] q exp(G); None when built for the summary only
    scores: Tensor | None  # [B, H, N, C, C] tril(q_i.k_j exp(G_i - G_j)); None as q_decayed
    seq_len: int  # tokens before padding


def kda_chunk_transforms(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    gate_bound: float | None = None,
    with_queries: bool = True,
) -> ChunkTransforms:
    """The per-chunk transforms of the delta rule (q, k normalised inside). Shapes as `chunk_kda_torch`.

    Inside a chunk the WY form replaces the token loop: with A = strict-lower beta_i k_i.k_j exp(G_i - G_j)
    (G: cumulative log decay within the chunk), u = (I + A)^-1 (beta v) and w = (I + A)^-1 (beta k exp(G)).
    `gate_bound`: a bound on |g| per token (the gate's lower bound) if known; it lets the diagonal sub-blocks
    of the scores use the factorised form. `with_queries=False` skips q_decayed and the q.k scores (summary
    only). Decays under exp(NEGLIGIBLE_EXPONENT) count as 0 (`_decay`), keeping the fp32 math clear of
    subnormals.
    """
    if chunk_size % SUB_CHUNK:
        raise ValueError(f"kda chunk_size must be a multiple of {SUB_CHUNK}, got {chunk_size}")
    dtype = at_least_fp32(v.dtype)
    seq_len, dk, dv = k.shape[1], k.shape[-1], v.shape[-1]
    pad = (-seq_len) % chunk_size

    def chunked(t: Tensor) -> Tensor:  # [B, S, H, *] -> [B, H, N, C, *] in `dtype`, zero padded
        t = t.to(dtype).transpose(1, 2)
        t = F.pad(t, (0, 0, 0, pad)) if t.dim() == 4 else F.pad(t, (0, pad))
        return t.unflatten(2, (-1, chunk_size))

    k = chunked(l2_normalise(k.to(dtype)))
    v, g, beta = chunked(v), chunked(g), chunked(beta).unsqueeze(-1)
    cum_g = g.cumsum(-2)  # [B, H, N, C, Dk]
    exact_diagonal = gate_bound is None or gate_bound * (SUB_CHUNK - 1) > SAFE_EXPONENT
    q = chunked(l2_normalise(q.to(dtype)) * dk**-0.5) if with_queries else None
    xs = (k * beta, q) if q is not None else (k * beta,)
    a_kk, *a_qk = _intra_chunk_scores(xs, k, cum_g, exact_diagonal)  # a_kk's diagonal is not used
    decay_in = _decay(cum_g)  # exp(G)
    rhs = torch.cat([v * beta, k * beta * decay_in], dim=-1)
    u, w = _UnitLowerSolve.apply(a_kk, rhs).split([dv, dk], dim=-1)
    g_last = cum_g[..., -1:, :]  # [B, H, N, 1, Dk]
    return ChunkTransforms(
        u=u,
        w=w,
        k_to_end=k * _decay(g_last - cum_g),
        chunk_decay=_decay(g_last.squeeze(-2)),
        q_decayed=q * decay_in if q is not None else None,
        scores=a_qk[0] if a_qk else None,
        seq_len=seq_len,
    )


def _chunk_recurrence(
    values: Tensor, transforms: ChunkTransforms, state: Tensor
) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """Carry a state [B, H, Dk, W] through the chunks: v' = values - w S, S <- exp(G_last) S + k_to_end^T v'.

    values: [B, H, N, C, W] (u for the delta rule). Returns the states entering each chunk and each chunk's v'
    (lists of N [B*H, ...] tensors) and the final state [B, H, Dk, W]. Runs on [B*H, ...] views: two fused
    multiply-adds per chunk.
    """
    batch, heads = values.shape[:2]
    state = state.flatten(0, 1)
    entering, corrected = [], []
    # unbind once: indexing chunk n in the loop would cost a full-size gradient buffer per chunk in backward
    per_chunk = zip(
        *(
            t.flatten(0, 1).unbind(1)
            for t in (
                values,
                transforms.w,
                transforms.chunk_decay.unsqueeze(-1),
                transforms.k_to_end.transpose(-1, -2),
            )
        )
    )
    for values_n, w_n, decay_n, k_n in per_chunk:
        entering.append(state)
        v_new = torch.baddbmm(values_n, w_n, state, alpha=-1.0)  # values - w S
        corrected.append(v_new)
        state = torch.baddbmm(state * decay_n, k_n, v_new)
    return entering, corrected, state.unflatten(0, (batch, heads))


def kda_chunk_outputs(transforms: ChunkTransforms, initial_state: Tensor | None) -> tuple[Tensor, Tensor]:
    """The delta rule's outputs from the chunk transforms and an incoming state [B, H, Dk, Dv] (None: zeros).

    o = (q exp(G)) S + tril(q_i.k_j exp(G_i - G_j)) (u - w S) per chunk, with S the state entering the chunk:
    the states come from the chunk loop, the outputs are batched matmuls after it. Returns the output
    [B, S, H, Dv] and the final state [B, H, Dk, Dv], both in the transforms' dtype.
    """
    q_decayed, scores = transforms.q_decayed, transforms.scores
    if q_decayed is None or scores is None:
        raise ValueError("these chunk transforms were built for the summary only (with_queries=False)")
    batch, heads, _, _, dk = transforms.w.shape
    dv = transforms.u.shape[-1]
    state = (
        transforms.u.new_zeros(batch, heads, dk, dv)
        if initial_state is None
        else initial_state.to(transforms.u.dtype)
    )
    entering, corrected, state = _chunk_recurrence(transforms.u, transforms, state)
    entering_all = torch.stack(entering, dim=1).unflatten(0, (batch, heads))  # [B, H, N, Dk, Dv]
    corrected_all = torch.stack(corrected, dim=1).unflatten(0, (batch, heads))  # [B, H, N, C, Dv]
    out = torch.baddbmm(
        (q_decayed @ entering_all).flatten(0, 2), scores.flatten(0, 2), corrected_all.flatten(0, 2)
    ).unflatten(0, (batch, heads, -1))
    out = out.flatten(2, 3)[:, :, : transforms.seq_len]
    return out.transpose(1, 2), state


def kda_segment_summary(transforms: ChunkTransforms) -> Tensor:
    """The segment's affine state map, packed [M | S_ext]: [B, H, Dk, Dk+Dv] in the transforms' dtype.

    S_out = M S_in + S_ext for any incoming state S_in (`apply_state_map`): M is the product of the chunk
    transitions M_n = diag(exp(G_last)) - k_to_end^T w (latest on the left), S_ext the final state from a zero
    start. Both come from one run of the chunk loop on the packed state [M | E] started at [I | 0] with values
    [0 | u] (each chunk maps it to [M_n M | M_n E + k_to_end^T u]).
    """
    batch, heads, _, _, dk = transforms.w.shape
    values = F.pad(transforms.u, (dk, 0))  # [0 | u]
    identity = torch.eye(dk, dtype=values.dtype, device=values.device).expand(batch, heads, dk, dk)
    start = F.pad(identity, (0, transforms.u.shape[-1]))  # [I | 0]
    return _chunk_recurrence(values, transforms, start)[2]


def apply_state_map(summary: Tensor, state: Tensor) -> Tensor:
    """M S + S_ext for a packed summary [..., Dk, Dk+Dv] and a state [..., Dk, Dv]."""
    dk = summary.shape[-2]
    return summary[..., :dk] @ state + summary[..., dk:]


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
    `kda_chunk_transforms` then `kda_chunk_outputs`. Returns output [B, S, H, Dv] (v's dtype) and the final
    state (fp32, fp64 for fp64 inputs).
    """
    transforms = kda_chunk_transforms(q, k, v, g, beta, chunk_size, gate_bound)
    out, state = kda_chunk_outputs(transforms, initial_state)
    return out.to(v.dtype), state


FLA_SAFE_BOUND = 5.0  # fla's `safe_gate` takes lower bounds in [-5, 0)


class FlaGate(NamedTuple):
    """KDA's forget gate as fla computes it inside `chunk_kda` (`use_gate_in_kernel=True`): `g` handed to the
    kernel is then the raw low-rank projection f [B, S, H, Dk], and the kernel forms
    g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) (fla's `kda_gate_chunk_cumsum`,
    `naive_kda_lowerbound_gate`), which is `kda.ForgetGate` term for term (`fla_gate_reference`)."""

    A_log: Tensor  # [H] fp32
    dt_bias: Tensor  # [H*Dk] fp32
    lower_bound: float  # in [-5, 0) (fla's safe_gate range)


def fla_gate_reference(raw: Tensor, gate: FlaGate) -> Tensor:
    """The gate formula fla's kernel applies, written in torch from fla's source (`fla/ops/kda/gate.py`,
    `naive_kda_lowerbound_gate`): raw [B, S, H, Dk] -> g [B, S, H, Dk] fp32. Steps as fla orders them: the
    input in fp32, plus dt_bias viewed [H, Dk], times exp(A_log) per head, then lower_bound * sigmoid."""
    heads = raw.shape[-2]
    g = raw.float() + gate.dt_bias.view(heads, -1)
    g = gate.A_log.view(heads, 1).float().exp() * g
    return gate.lower_bound * torch.sigmoid(g)


def fla_safe_gate(gate_bound: float | None) -> bool:
    """Whether fla's `safe_gate` (sub-chunks of 16 on tensor cores, for gates bounded below) may be used: a
    bound of at most 5 on |g| per token, which also keeps a sub-chunk's summed decay under SAFE_EXPONENT."""
    return gate_bound is not None and gate_bound <= FLA_SAFE_BOUND


def fla_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    gate_bound: float | None,
    gate: FlaGate | None = None,
) -> tuple[Tensor, Tensor]:
    """fla's `chunk_kda` with the inputs it runs natively: q, k, v, beta in the compute dtype (bf16 under
    autocast; `precision.compute_dtype`), the log decay g in fp32 (or, with `gate`, the raw gate input in the
    compute dtype: the kernel applies the gate), the state in fp32. Shapes as `chunk_kda_torch`; returns out
    [B, S, H, Dv] in v's dtype and the final state [B, H, Dk, Dv] fp32 (the contract of `kda_core`)."""
    if gate is not None and not -FLA_SAFE_BOUND <= gate.lower_bound < 0:
        raise ValueError(f"fla's in-kernel gate takes a lower bound in [-5, 0), got {gate.lower_bound}")
    chunk_kda = fla_chunk_kda()
    assert chunk_kda is not None, "select_kda_backend returns 'fla' only when it is installed"
    dtype = compute_dtype(q)
    options: dict = {}
    if fla_safe_gate(gate_bound):
        options.update(safe_gate=True, lower_bound=-gate_bound)
    if gate is not None:
        options.update(
            use_gate_in_kernel=True,
            safe_gate=True,
            lower_bound=gate.lower_bound,
            A_log=gate.A_log,
            dt_bias=gate.dt_bias,
        )
        g = g.to(dtype)
    else:
        g = g.float()
    with fp32_region(q):  # the dtypes are chosen here; fla's autocast decorators would recast them
        out, state = chunk_kda(
            q.to(dtype),
            k.to(dtype),
            v.to(dtype),
            g=g,
            beta=beta.to(dtype),
            initial_state=None if initial_state is None else initial_state.float(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            **options,
        )
    return out.to(v.dtype), state.float()


def chunk_kda_flops(batch: int, seq: int, heads: int, dk: int, dv: int, chunk: int = 64) -> int:
    """FLOPs of one chunked delta-rule forward (2 per multiply-add), as fla's `chunk_kda` runs it, per chunk
    and head: the q.k and k.k scores (2 C^2 Dk), the unit-lower solve applied to [beta v | beta k exp(G)]
    (C^2 (Dk+Dv)), the state recurrence's w S and k^T v' (2 C Dk Dv), the output's q S (C Dk Dv) and scores
    times v' (C^2 Dv). A backward is about twice this."""
    chunks = -(-seq // chunk)
    per_chunk = 2 * chunk * chunk * dk + chunk * chunk * (dk + dv) + 3 * chunk * dk * dv + chunk * chunk * dv
    return 2 * batch * heads * chunks * per_chunk


def chunk_kda_bytes(
    batch: int, seq: int, heads: int, dk: int, dv: int, input_bytes: int = 2, chunk: int = 64
) -> int:
    """HBM bytes one `chunk_kda` forward reads and writes, an estimate from shapes: q, k, v and the output
    in the input dtype, g in fp32, beta, the fp32 states in and out, and fla's saved per-chunk score blocks
    (Aqk, Akk [B, S, H, C] fp32) written once and read once."""
    tokens = batch * seq * heads
    activations = tokens * ((2 * dk + 2 * dv + 1) * input_bytes + 4 * dk)
    scores = 2 * 2 * tokens * chunk * 4
    states = 2 * batch * heads * dk * dv * 4
    return activations + scores + states


def fla_segment_summary(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, gate_bound: float | None, gate: FlaGate | None
) -> Tensor:
    """The segment's state map [M | S_ext] [B, H, Dk, Dk+Dv] fp32 (as `kda_segment_summary`) from one fla
    `chunk_kda` call: the delta rule is linear in (state, values) jointly, so the final state of a run on the
    packed values [0 | v] [B, S, H, Dk+Dv] started from [I | 0] is [M I + 0 | M 0 + S_ext]. Its output (the
    packed values' attention output) is not used; the gradient of the summary goes back through fla's own
    backward (its final-state gradient input). Inputs as `fla_kda`.

    fla's own context parallelism (`fla.ops.cp`) computes the same map: `chunk_cp_fwd_kernel_h` writes each
    rank's last local sequence as [h_local | M] (the zero-start final state, then the product of the chunk
    transitions diag(exp(G_last)) - k_to_end^T w, composed in fp32 with TF32x3 dots), all-gathers them inside
    `chunk_kda` and merges the chain (zigzag: fronts ascending, then backs descending, as our `ZIGZAG`); in
    backward it all-gathers the adjoint chain (`chunk_cp_bwd_dh`). It is taken only whole, through
    `chunk_kda(cp_context=...)`: its forward pre-process has no autograd of its own, it owns the collectives,
    takes batch 1 (varlen) and refuses an initial state and the final state, both of which `KDAState` carries
    across windows. So the summary runs on fla's `chunk_kda` here and the hand-over stays ours
    (`genomelm.parallel.exchange.hand_over_states`)."""
    batch, _, heads, dk = k.shape
    packed = F.pad(v, (dk, 0))  # [0 | v]
    identity = torch.eye(dk, dtype=torch.float32, device=k.device).expand(batch, heads, dk, dk)
    start = F.pad(identity, (0, v.shape[-1]))  # [I | 0]
    return fla_kda(q, k, packed, g, beta, start, gate_bound, gate)[1]


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
    transforms: ChunkTransforms | None = None,
    gate: FlaGate | None = None,
) -> tuple[Tensor, Tensor]:
    """The delta rule in a resolved backend ("fla", "torch", "recurrent"). Shapes as `chunk_kda_torch`.

    The torch and recurrent backends run in fp32 (fp64 for fp64 inputs) with autocast off (autocast would
    otherwise run their matmuls, and so the carried state, in bf16); fla's kernel takes q/k/v in the compute
    dtype and keeps its state in fp32 (`fla_kda`). `transforms`: the torch backend's chunk transforms if
    already built for these inputs (with queries, e.g. by `KDAttention.summarise`); the other backends do not
    use them. `gate` (fla only): g is the raw gate input and fla's kernel applies the gate. Returns out
    [B, S, H, Dv] in v's dtype and the final state (fp32, fp64 for fp64 inputs).
    """
    if backend == "fla":
        return fla_kda(q, k, v, g, beta, initial_state, gate_bound, gate)
    if gate is not None:
        raise ValueError(f"the in-kernel gate runs on the fla backend only, not {backend!r}")
    with fp32_region(q):
        if backend == "recurrent":
            return recurrent_kda(q, k, v, g, beta, initial_state)
        if transforms is None:
            return chunk_kda_torch(q, k, v, g, beta, initial_state, chunk_size, gate_bound)
        out, state = kda_chunk_outputs(transforms, initial_state)
        return out.to(v.dtype), state
