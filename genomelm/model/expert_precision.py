"""Low-precision routed-expert GEMMs (`RunOptions.expert_precision`): the grouped GEMMs of the routed experts
with their operands quantised as torchao's MoE training quantises them; everything else (router, shared
expert, attention, the weights kept and saved) as before.

- `fp8_rowwise` (Hopper and Blackwell; torchao `_to_fp8_rowwise_then_scaled_grouped_mm`): e4m3 values with
  power-of-2 fp32 scales. Forward: the activations per row, each expert's weight per output column (amax over
  the contraction dim). Input gradient: the output gradient per row, the weights per row (amax over the output
  dim). Weight gradient: the output gradient and the activations per column within each expert's rows.
  fp32 accumulation, output in the compute dtype.
- `mxfp8` (Blackwell; torchao `_to_mxfp8_then_scaled_grouped_mm`, RCEIL scales): e4m3 values with one e8m0
  scale per 32 consecutive values along the contraction dim of each of the three GEMMs.

On CUDA both take torchao's kernels (Triton quantisation, `torch._scaled_grouped_mm` for fp8 rowwise, its
CUTLASS MXFP8 grouped GEMM). Elsewhere the same numerics run emulated, which is how the CPU tests hold this
path to the bf16 one: MXFP8 through torchao's own emulation (`KernelPreference.EMULATED`: quantise,
dequantise, grouped GEMM), FP8 rowwise through `_EmulatedFp8Rowwise` here (torchao has no emulation of that
recipe, so it is written here from torchao's `tensor_to_scale` / `to_fp8_saturated`, the functions its own
torch reference uses).

Both kernels need each expert's rows to start at a multiple of 16 (fp8) or 32 (mxfp8) rows: `_aligned` places
the rows into a buffer of static size with every expert's group padded by zero rows, the places computed on
the device (no host sync, no shape that depends on the routing), and the output rows are gathered back.
"""

from __future__ import annotations

import torch
from torch import Tensor

EXPERT_PRECISIONS = ("bf16", "fp8_rowwise", "mxfp8")
ALIGN = {"fp8_rowwise": 16, "mxfp8": 32}  # rows of each expert's group, and the dims, a multiple of this
E4M3 = torch.float8_e4m3fn


def check_expert_precision(precision: str, dims: tuple[int, int]) -> None:
    """ValueError unless `precision` is one of `EXPERT_PRECISIONS` and, for a low precision, the experts'
    dims (hidden, intermediate) are multiples of its block (16 for fp8_rowwise, 32 for mxfp8)."""
    if precision not in EXPERT_PRECISIONS:
        raise ValueError(f"expert_precision must be one of {EXPERT_PRECISIONS}, got {precision!r}")
    align = ALIGN.get(precision)
    if align and any(dim % align for dim in dims):
        raise ValueError(
            f"expert_precision={precision} needs the experts' hidden and intermediate sizes {dims} to be "
            f"multiples of {align} (torchao's grouped GEMM); use expert_precision=bf16 for this model"
        )


def check_device(precision: str, device: torch.device) -> None:
    """ValueError where the GPU has no kernel for `precision`: fp8_rowwise needs compute capability 9.0+
    (Hopper), mxfp8 10.0+ (Blackwell). Other devices run the emulation."""
    if device.type != "cuda" or precision == "bf16":
        return
    need = (10, 0) if precision == "mxfp8" else (9, 0)
    capability = torch.cuda.get_device_capability(device)
    if capability < need:
        raise ValueError(
            f"expert_precision={precision} needs a GPU of compute capability {need[0]}.{need[1]}+, this one "
            f"is {capability[0]}.{capability[1]}: set expert_precision="
            f"{'fp8_rowwise' if capability >= (9, 0) else 'bf16'}"
        )


def low_precision_grouped_linear(x_sorted: Tensor, weight: Tensor, counts: Tensor, precision: str) -> Tensor:
    """Rows of x_sorted [N, in] times their expert's weight [E, out, in]^T, quantised by `precision`
    ("fp8_rowwise" or "mxfp8"): expert e owns the next counts[e] rows (counts [E] long) -> [N, out] in
    x_sorted's dtype. Differentiable in x_sorted and weight."""
    align = ALIGN[precision]
    padded, offsets, rows = _aligned(x_sorted, counts, align)
    weight_t = weight.transpose(-2, -1)  # [E, in, out], column-major per expert as the kernels take it
    out_dtype = x_sorted.dtype
    if precision == "fp8_rowwise":
        if x_sorted.device.type == "cuda":
            from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

            out = _to_fp8_rowwise_then_scaled_grouped_mm(
                padded, weight_t, offsets, out_dtype, E4M3, pad_token_groups_for_grouped_mm=False
            )
        else:
            out = _EmulatedFp8Rowwise.apply(padded, weight_t, offsets, out_dtype)
    else:
        from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm
        from torchao.quantization.quantize_.common import KernelPreference

        kernels = KernelPreference.AUTO if x_sorted.device.type == "cuda" else KernelPreference.EMULATED
        out = _to_mxfp8_then_scaled_grouped_mm(
            padded, weight_t, offsets, out_dtype=out_dtype, kernel_preference=kernels
        )
    return out[rows]


def _aligned(x_sorted: Tensor, counts: Tensor, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """x_sorted [N, D] grouped by expert (counts [E]) -> (the rows in a zero buffer [P, D] where every group
    starts at a multiple of `align`, P = N + E * (align - 1) rounded up to `align` whatever the routing; the
    groups' padded end offsets [E] int32; the place of each row in the buffer [N])."""
    n, experts = x_sorted.shape[0], counts.numel()
    padded_counts = (counts + align - 1) // align * align
    padded_starts = padded_counts.cumsum(0) - padded_counts
    starts = counts.cumsum(0) - counts
    arange = torch.arange(experts, device=counts.device)
    group = torch.repeat_interleave(arange, counts, output_size=n)  # the expert of each row
    rows = padded_starts[group] + torch.arange(n, device=counts.device) - starts[group]
    size = -(-(n + experts * (align - 1)) // align) * align
    padded = x_sorted.new_zeros(size, x_sorted.shape[1]).index_copy(0, rows, x_sorted)
    return padded, (padded_starts + padded_counts).to(torch.int32), rows


def _fake_e4m3(x: Tensor, dim: int) -> Tensor:
    """x quantised to e4m3 with a power-of-2 scale per slice along `dim` (its amax over `dim`), as fp32."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scale = tensor_to_scale(
        x,
        E4M3,
        scaling_granularity=ScalingGranularity.AXISWISE,
        axiswise_dim=dim,
        round_scales_to_power_of_2=True,
    )
    return to_fp8_saturated(x.float() * scale, E4M3).float() / scale


def _fake_e4m3_per_group_columns(x: Tensor, offsets: Tensor) -> Tensor:
    """x [M, D] quantised to e4m3 with a power-of-2 scale per column within each group of rows (groups end at
    `offsets` [E] int32; rows past the last belong to none and are left as zeros), as fp32."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    rows = torch.arange(x.shape[0], device=x.device)
    group = torch.searchsorted(offsets.to(torch.long), rows, right=True)  # [M], E for the trailing rows
    amax = x.new_zeros(offsets.numel() + 1, x.shape[1], dtype=torch.float32)
    amax = amax.scatter_reduce(0, group.unsqueeze(1).expand_as(x), x.abs().float(), "amax")
    scale = amax_to_scale(amax, E4M3, round_scales_to_power_of_2=True)[group]
    return to_fp8_saturated(x.float() * scale, E4M3).float() / scale


class _EmulatedFp8Rowwise(torch.autograd.Function):
    """torchao's FP8 rowwise grouped GEMM (`_Float8GroupedMM`) emulated: each operand of each of the three
    GEMMs quantised and dequantised as that function's kernels quantise it, then an fp32 grouped GEMM, the
    result in `out_dtype`. A [M, K] row-major, B_t [E, K, N], offsets [E] int32 (multiples of 16)."""

    @staticmethod
    def forward(ctx, a: Tensor, b_t: Tensor, offsets: Tensor, out_dtype: torch.dtype) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b_t, offsets)
        ctx.out_dtype = out_dtype
        out = torch._grouped_mm(_fake_e4m3(a, -1), _fake_e4m3(b_t, -2), offs=offsets)
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:  # type: ignore[override]
        a, b_t, offsets = ctx.saved_tensors
        grad_a = torch._grouped_mm(_fake_e4m3(grad, -1), _fake_e4m3(b_t, -1).transpose(-2, -1), offs=offsets)
        grad_columns = _fake_e4m3_per_group_columns(grad, offsets)
        a_columns = _fake_e4m3_per_group_columns(a, offsets)
        grad_b_t = torch._grouped_mm(a_columns.t(), grad_columns, offs=offsets)  # [E, K, N]
        return grad_a.to(ctx.out_dtype), grad_b_t.to(b_t.dtype), None, None
