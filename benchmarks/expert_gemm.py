"""The routed experts' low-precision grouped GEMM on a GPU (`expert_precision=fp8_rowwise | mxfp8`): torchao's
kernels, as `Experts.expert_rows` calls them on CUDA, against the same numerics emulated on the CPU (what the
CPU tests hold to bf16), and their forward + backward time against the bf16 grouped GEMM at GLM-5.3-Flash's
expert shape (hidden 4096, intermediate 2048: the gate/up projection [E, 4096, 4096]).
`benchmarks/gpu_check.py` runs `check` as one row per precision; the speed-up is the figure the planner's
expert GEMM rate needs.

    python benchmarks/expert_gemm.py            # one CUDA GPU: fp8_rowwise (Hopper+), mxfp8 (Blackwell)

ok: the kernels' output and both gradients within 1e-2 (relative L2) of the emulation's (fp32 accumulation in
both; the kernels' fast accumulation and scale reciprocals differ in the last bits), and within 6% of bf16's
(the CPU measured 3.7-3.8%, tests/test_expert_precision.py).
"""

from __future__ import annotations

import time

import torch

from genomelm.model.expert_precision import low_precision_grouped_linear

HIDDEN, OUT = 4096, 4096  # the gate/up projection of one expert: [2 x 2048, 4096]
EXPERTS = 8  # local experts in the timed GEMM (the slice of gpu_check routes to 8)
TIMED_ROWS = 65536  # (token, expert) rows of one timed GEMM: a moe_chunk_tokens=8192 chunk's 8 per token
CHECKED_ROWS = 2048  # rows of the kernel-against-emulation comparison (the emulation runs on the CPU)
REPEATS = 5


def _counts(rows: int, generator: torch.Generator) -> torch.Tensor:
    """Uneven rows per expert (summing to `rows`): what routing gives, none a multiple of the alignment."""
    share = torch.rand(EXPERTS, generator=generator) + 0.5
    counts = (share / share.sum() * rows).long()
    counts[-1] += rows - counts.sum()
    return counts


def _step(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grad: torch.Tensor, precision: str):
    """Forward and backward of one grouped GEMM: (out, grad of x, grad of weight)."""
    x = x.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    if precision == "bf16":
        offsets = counts.cumsum(0).to(torch.int32)
        out = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    else:
        out = low_precision_grouped_linear(x, weight, counts, precision)
    out.backward(grad)
    return out.detach(), x.grad, weight.grad


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm().clamp_min(1e-30))


def _seconds(device: torch.device, precision: str, tensors: tuple[torch.Tensor, ...]) -> float:
    """Mean seconds of a forward + backward, after one warm-up (Triton's compile and autotune)."""
    _step(*tensors, precision)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(REPEATS):
        _step(*tensors, precision)
    torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / REPEATS


def _inputs(rows: int, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    counts = _counts(rows, generator)
    x = torch.randn(rows, HIDDEN, generator=generator).to(device, torch.bfloat16)
    weight = (torch.randn(EXPERTS, OUT, HIDDEN, generator=generator) * HIDDEN**-0.5).to(
        device, torch.bfloat16
    )
    grad = torch.randn(rows, OUT, generator=generator).to(device, torch.bfloat16)
    return x, weight, counts.to(device), grad


def check(device: torch.device, precision: str) -> dict:
    """The kernels against the CPU emulation and bf16 (relative L2 of output, input and weight gradients), and
    the forward + backward time of bf16 and of `precision` at TIMED_ROWS rows."""
    small = _inputs(CHECKED_ROWS, device, 0)
    kernels = _step(*small, precision)
    emulated = _step(*(t.cpu() for t in small), precision)
    bf16 = _step(*small, "bf16")
    names = ("out", "grad_x", "grad_weight")
    vs_emulation = {n: _relative(k, e) for n, k, e in zip(names, kernels, emulated, strict=True)}
    vs_bf16 = {n: _relative(k, b) for n, k, b in zip(names, kernels, bf16, strict=True)}
    timed = _inputs(TIMED_ROWS, device, 1)
    bf16_s = _seconds(device, "bf16", timed)
    low_s = _seconds(device, precision, timed)
    flops = 3 * 2 * TIMED_ROWS * HIDDEN * OUT  # forward, input and weight gradients
    return {
        "ok": max(vs_emulation.values()) <= 1e-2 and max(vs_bf16.values()) <= 0.06,
        "vs_emulation": vs_emulation,
        "vs_bf16": vs_bf16,
        "bf16_ms": bf16_s * 1e3,
        "low_ms": low_s * 1e3,
        "speedup": bf16_s / low_s,
        "bf16_tflops": flops / bf16_s / 1e12,
        "low_tflops": flops / low_s / 1e12,
    }


def main() -> None:
    device = torch.device("cuda")
    capability = torch.cuda.get_device_capability(device)
    for precision in ("fp8_rowwise", "mxfp8"):
        if capability < ((10, 0) if precision == "mxfp8" else (9, 0)):
            print(f"{precision}: not on compute capability {capability[0]}.{capability[1]}")
            continue
        result = check(device, precision)
        status = "ok" if result["ok"] else "MISMATCH"
        print(f"{precision}: {status}; vs emulation {result['vs_emulation']}; vs bf16 {result['vs_bf16']}")
        print(
            f"  fwd+bwd {result['low_ms']:.2f} ms against bf16 {result['bf16_ms']:.2f} ms "
            f"({result['speedup']:.2f}x; {result['low_tflops']:.0f} against {result['bf16_tflops']:.0f} "
            "TFLOP/s)"
        )


if __name__ == "__main__":
    main()
