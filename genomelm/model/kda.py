"""Kimi delta attention (KDA), the linear-attention layer of GLM-5.3-Flash.

Layer: q/k/v projections -> causal depthwise conv (width K) + SiLU -> per-channel decay gate (low rank, with a
lower bound) and beta -> delta rule over the sequence (`kda_chunk.kda_core`, in the backend that
`kda_chunk.select_kda_backend` picks) -> sigmoid-gated RMS norm per head -> output projection.

`KDAState` carries the recurrent state and the conv tail so that a sequence processed in pieces equals the
whole. `KDAttention` exposes its steps (`project`, `convolve`, `gates`, `summarise`, `core`, `output`) for
context parallelism (`genomelm.parallel`); this module itself never communicates.

The conv, the gates and the delta rule run in fp32, or in fp64 for an fp64 model (`precision.at_least_fp32`),
on the torch paths. On the fla backend (CUDA) fla's kernels run them: `causal_conv1d` (fp32 accumulation),
`chunk_kda` fed q/k/v in the compute dtype with its fp32 state, and with `RunOptions.kda_gate_in_kernel` the
gate itself (`ForgetGate` gives the correspondence). `route` names what runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig, RunOptions
from .kda_chunk import (
    FLA_SAFE_BOUND,
    KDA_BACKENDS,
    ChunkTransforms,
    FlaGate,
    fla_causal_conv1d,
    fla_chunk_kda,
    fla_segment_summary,
    kda_chunk_transforms,
    kda_core,
    kda_segment_summary,
    select_kda_backend,
)
from .norms import GatedRMSNorm
from .precision import at_least_fp32, compute_dtype, fp32_region

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


class KDAState(NamedTuple):
    """What a KDA layer hands to the next piece of the same sequence."""

    recurrent: Tensor  # [B, H, Dk, Dv] fp32
    conv_tail: Tensor  # [B, 3*H*Dk, K-1], the last K-1 conv inputs (zeros before the sequence starts)


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


def fla_depthwise_conv(rows: Tensor, halo: Tensor, weight: Tensor) -> Tensor:
    """`causal_depthwise_conv` + SiLU in fla's `causal_conv1d` (depthwise, no bias, SiLU inside, fp32
    accumulation, out in rows' dtype): rows [B, S, C] after halo [B, K-1, C], weight [C, 1, K] -> [B, S, C].
    The halo is the kernel's initial state [B, C, K]: it reads column K-1-j as the row j+1 steps before the
    first, so the halo's rows transposed fill columns 1..K-1 and column 0 is never read; the halo's gradient
    comes back as the initial state's."""
    causal_conv1d = fla_causal_conv1d()
    assert causal_conv1d is not None, "the fla conv runs only when fla is installed (`KDAttention.fla_conv`)"
    initial = F.pad(halo.to(rows.dtype).transpose(1, 2), (1, 0))  # [B, C, K]
    out, _ = causal_conv1d(
        rows, weight=weight[:, 0], initial_state=initial, activation="silu", backend="triton"
    )
    return out


class ForgetGate(nn.Module):
    """Per-channel log decay g <= 0 from a low-rank projection. `dt_bias` [H*Dk] and `A_log` [H] are fp32.

    With a lower bound b: g = b * sigmoid(exp(A_log) * (f + dt_bias)), so b < g < 0; without:
    g = -exp(A_log) * softplus(f + dt_bias). f = `raw(x)`, the low-rank projection.

    fla's in-kernel gate (`chunk_kda(use_gate_in_kernel=True, A_log, dt_bias, lower_bound, safe_gate=True)`)
    computes the bounded form from the same f, A_log and dt_bias: it loads f, adds dt_bias [H*Dk] viewed per
    head and channel in fp32, multiplies by exp(A_log[h]) and takes lower_bound * sigmoid
    (`fla/ops/kda/gate.py`; `kda_chunk.fla_gate_reference` is that formula in torch). `fla_gate` hands it
    these parameters.
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

    def raw(self, x: Tensor) -> Tensor:
        """x: [B, S, D] -> the gate's input f [B, S, H, Dk] (the projections' dtype)."""
        return self.f_b_proj(self.f_a_proj(x)).unflatten(-1, (self.num_heads, -1))

    def fla_gate(self) -> FlaGate:
        """The parameters fla's in-kernel gate takes (the bounded form only)."""
        if self.lower_bound is None:
            raise ValueError("fla's in-kernel KDA gate is used with a lower bound only (linear_lower_bound)")
        return FlaGate(self.A_log, self.dt_bias, self.lower_bound)

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, S, D] -> g [B, S, H, Dk] fp32 (fp64 for an fp64 model)."""
        dtype = at_least_fp32(x.dtype)
        f = self.raw(x).to(dtype) + self.dt_bias.to(dtype).view(self.num_heads, -1)
        rate = self.A_log.to(dtype).exp().view(self.num_heads, 1)
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
        self.gate_in_kernel = options.kda_gate_in_kernel  # on the fla backend only
        if self.gate_in_kernel and (self.gate_bound is None or self.gate_bound > FLA_SAFE_BOUND):
            raise ValueError(
                "kda_gate_in_kernel needs a gate lower bound in [-5, 0) (fla's safe gate), "
                f"linear_lower_bound is {config.linear_lower_bound}"
            )
        self.backend: str | None = None  # resolved at the first forward, on the input's device
        self.fla_dtype: torch.dtype | None = None  # what q/k/v reach fla in, noted at its first call
        self.route = f"kda: {options.kda_backend} (resolved at the first forward)"

    def resolve_backend(self, device: torch.device) -> str:
        """The delta rule's backend for inputs on `device`, chosen at the first call; names it in `route`."""
        if self.backend is None:
            self.backend = select_kda_backend(
                self.requested_backend, device.type, fla_chunk_kda() is not None
            )
            self.route = {
                "fla": self._fla_route(),
                "torch": f"kda: torch chunked (chunk {self.chunk_size})",
                "recurrent": "kda: recurrent token loop (reference)",
            }[self.backend]
        return self.backend

    @property
    def fla_gate_active(self) -> bool:
        """Whether fla's kernel applies the forget gate (`RunOptions.kda_gate_in_kernel`, fla backend)."""
        return self.gate_in_kernel and self.backend == "fla"

    @property
    def fla_conv(self) -> bool:
        """Whether the short conv runs in fla's `causal_conv1d` (on the fla backend, when fla has it)."""
        return self.backend == "fla" and fla_causal_conv1d() is not None

    @property
    def summary_route(self) -> str:
        """Where a context-parallel segment summary runs (`summarise`), for the route under CP."""
        if self.backend == "fla":
            return "fla chunk_kda ([0 | v] from [I | 0])"
        return f"torch chunked (chunk {self.chunk_size}, fp64 solve)"

    def _fla_route(self) -> str:
        details = ["cuda"]
        if self.fla_dtype is not None:
            details.append(f"{DTYPE_NAMES.get(self.fla_dtype, str(self.fla_dtype))} q/k/v")
        if self.gate_in_kernel:
            details.append("gate in kernel")
        conv = "fla causal_conv1d" if fla_causal_conv1d() is not None else "torch"
        return f"kda: fla chunk_kda ({', '.join(details)}; conv: {conv})"

    def _note_fla_inputs(self, q: Tensor) -> None:
        """Name in `route` the dtype fla's kernel is fed (known at the first call: autocast decides it)."""
        if self.fla_dtype is None:
            before = self._fla_route()
            self.fla_dtype = compute_dtype(q)
            if self.route.startswith(before):  # keeps a note appended by context parallelism
                self.route = self._fla_route() + self.route[len(before) :]

    def initial_state(self, batch: int, dtype: torch.dtype, device: torch.device) -> KDAState:
        """Zero state: what a sequence starts from (recurrent part fp32, fp64 for an fp64 model)."""
        width = self.num_heads * self.head_dim
        return KDAState(
            torch.zeros(
                batch,
                self.num_heads,
                self.head_dim,
                self.head_dim,
                dtype=at_least_fp32(dtype),
                device=device,
            ),
            torch.zeros(batch, 3 * width, self.kernel - 1, dtype=dtype, device=device),
        )

    # The layer's steps in order: `forward` chains them, `genomelm.parallel` calls them around its exchanges.
    def project(self, x: Tensor) -> Tensor:
        """x [B, S, D] -> the conv's input rows [B, S, 3W] (q | k | v projections, W = H*Dk)."""
        return F.linear(x, torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))

    def convolve(self, rows: Tensor, halo: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """Causal depthwise conv + SiLU of rows [B, S, 3W] after halo [B, K-1, 3W] (the K-1 rows before them;
        zeros at the start of a sequence) -> q, k, v [B, S, H, Dk] in `dtype`. The torch conv runs in its
        weight's dtype (fp32); on the fla backend fla's `causal_conv1d` runs it (`fla_conv`)."""
        if self.resolve_backend(rows.device) == "fla" and self.fla_conv:
            conv = fla_depthwise_conv(rows, halo, self.conv1d.weight)
        else:
            padded = torch.cat([halo.to(rows.dtype), rows], dim=1)  # [B, K-1+S, 3W]
            conv = F.silu(causal_depthwise_conv(padded.to(self.conv1d.weight.dtype), self.conv1d.weight))
        q, k, v = conv.to(dtype).unflatten(-1, (3 * self.num_heads, self.head_dim)).chunk(3, dim=2)
        return q, k, v

    def gates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, S, D] -> log decay g [B, S, H, Dk] (fp32) and beta [B, S, H] (x's dtype). With fla's
        in-kernel gate (`fla_gate_active`) g is the gate's raw input f instead (`ForgetGate.raw`)."""
        self.resolve_backend(x.device)
        g = self.forget_gate.raw(x) if self.fla_gate_active else self.forget_gate(x)
        return g, torch.sigmoid(self.b_proj(x))

    def summarise(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
    ) -> tuple[Tensor, ChunkTransforms | None]:
        """The segment's state map [M | S_ext] [B, H, Dk, Dk+Dv] (fp32, fp64 for an fp64 model) and what to
        pass on to `core`: on the torch paths `kda_segment_summary` and the chunk transforms it came from
        (used again by the torch backend), on fla one `chunk_kda` call (`fla_segment_summary`) and None."""
        backend = self.resolve_backend(q.device)
        if backend == "fla":
            self._note_fla_inputs(q)
            return fla_segment_summary(q, k, v, g, beta, self.gate_bound, self._fla_gate()), None
        with fp32_region(q):
            transforms = kda_chunk_transforms(
                q, k, v, g, beta, self.chunk_size, self.gate_bound, with_queries=backend == "torch"
            )
            return kda_segment_summary(transforms), transforms

    def _fla_gate(self) -> FlaGate | None:
        return self.forget_gate.fla_gate() if self.fla_gate_active else None

    def core(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        initial_state: Tensor | None,
        transforms: ChunkTransforms | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The delta rule from `initial_state` [B, H, Dk, Dv] -> (out [B, S, H, Dv], final state); see
        `kda_core`. g: as `gates` returns it."""
        backend = self.resolve_backend(q.device)
        if backend == "fla":
            self._note_fla_inputs(q)
        return kda_core(
            backend,
            q,
            k,
            v,
            g,
            beta,
            initial_state,
            self.chunk_size,
            self.gate_bound,
            transforms,
            self._fla_gate(),
        )

    def output(self, x: Tensor, core: Tensor) -> Tensor:
        """Gated RMS norm of the delta rule's output core [B, S, H, Dv] (gate from x [B, S, D]), then the
        output projection -> [B, S, D]."""
        gate = self.g_b_proj(self.g_a_proj(x)).unflatten(-1, (self.num_heads, self.head_dim))
        return self.o_proj(self.o_norm(core, gate).flatten(2))

    def forward(self, x: Tensor, state: KDAState | None = None) -> tuple[Tensor, KDAState]:
        """x: [B, S, D] -> (y [B, S, D], state after the last token)."""
        if state is None:
            state = self.initial_state(x.shape[0], x.dtype, x.device)
        rows = self.project(x)
        halo = state.conv_tail.transpose(1, 2).to(rows.dtype)
        q, k, v = self.convolve(rows, halo, x.dtype)
        seq_len = rows.shape[1]  # the state's tail: the last K-1 rows of [halo, rows], also when S < K-1
        conv_tail = torch.cat([halo[:, seq_len:], rows[:, max(seq_len - halo.shape[1], 0) :]], dim=1)
        g, beta = self.gates(x)
        core, recurrent = self.core(q, k, v, g, beta, state.recurrent)
        return self.output(x, core), KDAState(recurrent, conv_tail.transpose(1, 2))
