"""Kimi delta attention (KDA), the linear-attention layer of GLM-5.3-Flash.

Layer: q/k/v projections -> causal depthwise conv (width K) + SiLU -> per-channel decay gate (low rank, with a
lower bound) and beta -> delta rule over the sequence (`kda_chunk.kda_core`, in the backend that
`kda_chunk.select_kda_backend` picks) -> sigmoid-gated RMS norm per head -> output projection.

`KDAState` carries the recurrent state and the conv tail so that a sequence processed in pieces equals the
whole. `KDAttention` exposes its steps (`project`, `convolve`, `gates`, `summarise`, `core`, `output`) for
context parallelism (`genomelm.parallel`); this module itself never communicates.

The conv, the gates and the delta rule run in fp32, or in fp64 for an fp64 model (`precision.at_least_fp32`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig, RunOptions
from .kda_chunk import (
    KDA_BACKENDS,
    ChunkTransforms,
    fla_chunk_kda,
    kda_chunk_transforms,
    kda_core,
    kda_segment_summary,
    select_kda_backend,
)
from .norms import GatedRMSNorm
from .precision import at_least_fp32, fp32_region


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
        """x: [B, S, D] -> g [B, S, H, Dk] fp32 (fp64 for an fp64 model)."""
        dtype = at_least_fp32(x.dtype)
        f = (self.f_b_proj(self.f_a_proj(x)).to(dtype) + self.dt_bias.to(dtype)).unflatten(
            -1, (self.num_heads, -1)
        )
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
        self.backend: str | None = None  # resolved at the first forward, on the input's device
        self.route = f"kda: {options.kda_backend} (resolved at the first forward)"

    def resolve_backend(self, device: torch.device) -> str:
        """The delta rule's backend for inputs on `device`, chosen at the first call; names it in `route`."""
        if self.backend is None:
            self.backend = select_kda_backend(
                self.requested_backend, device.type, fla_chunk_kda() is not None
            )
            self.route = {
                "fla": "kda: fla chunk_kda (cuda)",
                "torch": f"kda: torch chunked (chunk {self.chunk_size})",
                "recurrent": "kda: recurrent token loop (reference)",
            }[self.backend]
        return self.backend

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
        zeros at the start of a sequence) -> q, k, v [B, S, H, Dk] in `dtype`. The conv runs in its weight's
        dtype (fp32)."""
        padded = torch.cat([halo.to(rows.dtype), rows], dim=1)  # [B, K-1+S, 3W]
        conv = causal_depthwise_conv(padded.to(self.conv1d.weight.dtype), self.conv1d.weight)
        q, k, v = F.silu(conv).to(dtype).unflatten(-1, (3 * self.num_heads, self.head_dim)).chunk(3, dim=2)
        return q, k, v

    def gates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, S, D] -> log decay g [B, S, H, Dk] (fp32) and beta [B, S, H] (x's dtype)."""
        return self.forget_gate(x), torch.sigmoid(self.b_proj(x))

    def summarise(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
    ) -> tuple[Tensor, ChunkTransforms]:
        """The segment's state map [M | S_ext] [B, H, Dk, Dk+Dv] (`kda_segment_summary`, torch math whatever
        the backend) and the chunk transforms it came from, to pass to `core` (used there by the torch
        backend)."""
        backend = self.resolve_backend(q.device)
        with fp32_region(q):
            transforms = kda_chunk_transforms(
                q, k, v, g, beta, self.chunk_size, self.gate_bound, with_queries=backend == "torch"
            )
            return kda_segment_summary(transforms), transforms

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
        `kda_core`."""
        backend = self.resolve_backend(q.device)
        return kda_core(
            backend, q, k, v, g, beta, initial_state, self.chunk_size, self.gate_bound, transforms
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
