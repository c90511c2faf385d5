"""The fused mHC kernels against the torch path: one block's hyper-connection at GLM-5.3-Flash width.

One comparison is what a decoder layer does around one block: the mixing weights and collapse
(`HyperConnection.forward`), an identity block (the block input cast to the streams' dtype) and the combine,
then the backward from a fixed random gradient of the new streams. Both paths get the same bf16 streams and
weights; the errors are each output's and gradient's largest difference over its largest entry (outputs: post,
comb, block input, new streams; gradients: streams, fn, base, scale), the worst of them reported.

Tolerance (`TOLERANCE`): both paths compute in fp32 from the same bf16 values and round their bf16 outputs
once (2^-8 of an entry); the kernel path also sums three bf16 stream gradients where the torch path sums two
of them in fp32, so its stream gradient is up to ~3 bf16 roundings from the torch path's: 1e-2 of the largest
entry.

`check(tokens, device)` is called by `benchmarks/gpu_check.py`; `--cpu-smoke` runs tiny fp32 shapes on the
CPU under Triton's interpreter and prints one table row.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from genomelm.model import ModelConfig, RunOptions
from genomelm.model.mhc import HyperConnection

TOLERANCE = 1e-2  # largest difference over the largest entry, for bf16 streams
REPEATS = 5


def _pair(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> dict[str, HyperConnection]:
    """The torch path and the kernels with the same random weights (fn in the model dtype, base/scale
    fp32)."""
    gen = torch.Generator().manual_seed(0)
    mixes = config.hc_mult * (2 + config.hc_mult)
    fn = torch.randn(mixes, config.hc_mult * config.hidden_size, generator=gen)
    weights = {
        "fn": (fn * config.initializer_range).to(dtype),
        "base": torch.randn(mixes, generator=gen) * 0.3,
        "scale": 0.5 + torch.rand(3, generator=gen),
    }
    pair = {}
    for backend in ("torch", "triton"):
        hc = HyperConnection(config, RunOptions(mhc_backend=backend))
        for name, value in weights.items():
            setattr(hc, name, torch.nn.Parameter(value.clone()))
        pair[backend] = hc.to(device)
    return pair


def _step(hc: HyperConnection, streams: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """Forward + backward of one hyper-connected identity block -> [outputs..., gradients...]."""
    hc.zero_grad(set_to_none=True)
    streams = streams.detach().requires_grad_(True)
    post, comb, block_input = hc(streams)
    new = hc.combine(post, comb, block_input.to(streams.dtype), streams)
    new.backward(grad)
    outputs = [post.detach(), comb.detach(), block_input.detach(), new.detach()]
    return outputs + [streams.grad, hc.fn.grad, hc.base.grad, hc.scale.grad]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _milliseconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Mean wall time of `fn` after one warm-up call (synchronised on CUDA)."""
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / repeats * 1e3


def _peak_gib(fn: Callable[[], object], device: torch.device) -> float | None:
    """GPU memory allocated at the peak of one call beyond what was allocated before it (None off CUDA)."""
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def compare(
    tokens: int,
    device: torch.device,
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    repeats: int = REPEATS,
) -> dict:
    """Both paths on the same [1, tokens, N, D] streams of `dtype`: errors, times, TFLOP/s and peaks."""
    pair = _pair(config, device, dtype)
    gen = torch.Generator().manual_seed(1)
    shape = (1, tokens, config.hc_mult, config.hidden_size)
    streams = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    grad = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    results = {backend: _step(hc, streams, grad) for backend, hc in pair.items()}
    errors = [
        ((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()
        for ours, ref in zip(results["triton"], results["torch"], strict=True)
    ]
    del results
    torch_peak = _peak_gib(lambda: _step(pair["torch"], streams, grad), device)
    kernel_peak = _peak_gib(lambda: _step(pair["triton"], streams, grad), device)
    torch_ms = _milliseconds(lambda: _step(pair["torch"], streams, grad), device, repeats)
    kernel_ms = _milliseconds(lambda: _step(pair["triton"], streams, grad), device, repeats)
    with FlopCounterMode(display=False) as counter:
        _step(pair["triton"], streams, grad)
    kernel_flops = sum(
        flops for op, flops in counter.get_flop_counts()["Global"].items() if str(op).startswith("genomelm.")
    )
    worst = max(errors)
    return {
        "name": "mhc fused (mix, collapse, combine; fwd + bwd)",
        "tokens": tokens,
        "max_rel_error": worst,
        "errors": dict(
            zip(
                ("post", "comb", "block_input", "new_streams", "d_streams", "d_fn", "d_base", "d_scale"),
                errors,
                strict=True,
            )
        ),
        "torch_ms": torch_ms,
        "kernel_ms": kernel_ms,
        "speedup": torch_ms / kernel_ms,
        "kernel_tflops": kernel_flops / (kernel_ms * 1e-3) / 1e12,
        "torch_peak_gib": torch_peak,
        "kernel_peak_gib": kernel_peak,
        "route": pair["triton"].route,
        "ok": worst < TOLERANCE,
    }


def check(tokens: int, device: torch.device, smoke: bool = False) -> dict:
    """GLM-5.3-Flash's hyper-connection (N = 4 streams of 4096) at `tokens` tokens, bf16 streams; `smoke`:
    4 streams of 64, fp32, one repeat (the CPU under Triton's interpreter)."""
    if not smoke:
        return compare(tokens, device, ModelConfig.preset("glm-5.3-flash"))
    config = dataclasses.replace(ModelConfig.preset("tiny"), hidden_size=64, hc_mult=4)
    result = compare(tokens, device, config, dtype=torch.float32, repeats=1)
    result["ok"] = result["max_rel_error"] < 1e-5  # fp32: summation order only
    return result


def row(result: dict) -> str:
    """One Markdown table row of a `check` result."""

    def gib(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    return (
        f"| {result['name']} | {result['tokens']} | {result['max_rel_error']:.2e} | "
        f"{result['torch_ms']:.2f} | {result['kernel_ms']:.2f} | {result['speedup']:.2f}x | "
        f"{result['kernel_tflops']:.3f} | "
        f"{gib(result['torch_peak_gib'])} | {gib(result['kernel_peak_gib'])} | {result['ok']} |"
    )


HEADER = (
    "| check | tokens | max rel error | torch ms | kernel ms | speedup | kernel TFLOP/s | torch peak GiB | "
    "kernel peak GiB | ok |"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny fp32 shapes on the CPU under the Triton interpreter"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536])
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first imported, at the first forward
        rows = [check(37, torch.device("cpu"), smoke=True)]
    else:
        rows = [check(tokens, torch.device("cuda")) for tokens in args.tokens]
    print(HEADER)
    print("|---" * 10 + "|")
    for result in rows:
        print(row(result))
    return 0 if all(result["ok"] for result in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
