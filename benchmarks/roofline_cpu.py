"""The roofline projection (`genomelm.plan.roofline`) checked on this CPU: this machine's peaks measured at
start (an fp32 and a bf16 linear layer's GFLOP/s, forward and backward, the grouped GEMM's, a copy's
bandwidth, the cost of one eager op in the model's own step at 256 tokens), then the op list of the
planner's trace of a whole model's training step (fake tensors; fwd + bwd with recompute, AdamW) costed with
them, beside the measured seconds of the same step on real tensors (the median of a few).

The trace takes the paths the CPU step runs (the kernel switches' torch paths: the planner's own trace
takes the GPU's kernels), and the process runs with the Makefile's CPU allocator settings (`CPU_MALLOC`, set
by re-running itself): without them every large temporary maps fresh pages, whose faults cost more than
the op's bytes and vary with the machine's load.

    python benchmarks/roofline_cpu.py                 # tiny at 4k, small at 4k and 16k
    python benchmarks/roofline_cpu.py --only small:16k

Prints one row per case and, as its last line, `predicted <s> s, measured <s> s, ratio <r>` for the last case
(small at 16k by default). One thread throughout: the machine is shared, and one thread measures steadily.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from genomelm.model import ModelConfig
from genomelm.plan import roofline
from genomelm.plan.rates import Links, Peaks
from genomelm.plan.trace import StepTrace, real_step, trace_step
from genomelm.run.config import TrainConfig

CASES = ("tiny:4k", "small:4k", "small:16k")
# the Makefile's CPU_MALLOC: glibc reuses freed memory instead of mapping fresh pages for each large temporary
CPU_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": "17179869184",
    "MALLOC_TRIM_THRESHOLD_": "68719476736",
    "MALLOC_TOP_PAD_": "1073741824",
}
# the kernel switches at the torch paths a CPU step runs ("auto" traces the GPU's Triton and fla kernels)
CPU_PATHS = ("indexer_backend=torch", "dsa_backend=sparse", "mhc_backend=torch", "kda_backend=torch")
TOLERANCE = 0.30  # predicted within 30% of measured
CALIBRATION_TOKENS = 256  # the step whose time per kernel is the eager op cost


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _KernelCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that launch a kernel (`roofline.is_kernel`), as the trace counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN201
        self.kernels += roofline.is_kernel(func)
        return func(*args, **(kwargs or {}))


def _tiny_graph() -> None:
    """A chain of small ops with autograd (forward and backward): what an eager op costs beyond its data."""
    x = torch.ones(8, 8, requires_grad=True)
    y = x
    for _ in range(64):
        y = torch.tanh(y * 1.01 + 0.1)
    y.sum().backward()


_GROUP_SIZES = torch.Generator().manual_seed(0)  # one stream for the process: each call draws new sizes


def grouped_gemm_flops(rows: int = 8192, groups: int = 16, width: int = 128, repeats: int = 5) -> float:
    """FLOP/s of torch's CPU grouped GEMM in bf16 as the experts run it: forward and both gradients (the
    weight gradient's transposed operand included), group sizes not seen before at each call, as routing
    makes them (the CPU kernel compiles itself per new size, most of its cost), `rows` rows over `groups`
    experts of `width` x `width`."""
    x = torch.randn(rows, width, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(groups, width, width, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows, width, dtype=torch.bfloat16)

    def step() -> None:
        cuts = torch.randint(0, rows, (groups - 1,), generator=_GROUP_SIZES).sort().values
        offsets = torch.cat([cuts, torch.tensor([rows])]).to(torch.int32)
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets).backward(grad)

    return 3 * 2 * rows * width * width / _median_seconds(step, repeats)


def linear_gemm_flops(dtype: torch.dtype, n: int, repeats: int) -> tuple[float, float]:
    """FLOP/s of a linear layer's products as the model runs them (n x n each): the forward's x wᵀ (a
    recompute's too), and the backward's g w and gᵀ x together. The operands' layouts matter on a CPU without
    native bf16 (AVX2): there oneDNN runs x wᵀ at ~8 GFLOP/s, gᵀ x at ~20 and g w at ~1, so one plain n x n
    product misstates the step's matmuls."""
    x, w, grad = (torch.randn(n, n, dtype=dtype) for _ in range(3))
    forward = 2 * n**3 / _median_seconds(lambda: torch.nn.functional.linear(x, w), repeats)
    backward = 2 * 2 * n**3 / _median_seconds(lambda: (grad @ w, grad.t() @ x), repeats)
    return forward, backward


def cpu_peaks(matmul: int = 1024, copy_mib: int = 64, repeats: int = 5) -> Peaks:
    """This CPU's peaks, measured now on the current thread count: fp32 and bf16 matmul FLOP/s (a linear
    layer's forward and backward at n x n, `linear_gemm_flops`; "fp32" serves tf32 too), the grouped GEMM's
    (`grouped_gemm_flops`), copy bandwidth (read + write of `copy_mib` MiB), and the seconds of one eager
    kernel (a chain of tiny ops with autograd, over the kernels it dispatches). No efficiency factor: the
    measured peaks are what this machine reaches. The backward's GEMMs get their own rate (`rate_key`)."""
    flops, backward = {}, {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        flops[name], backward[name] = linear_gemm_flops(dtype, matmul, repeats)
    flops |= {"tf32": flops["fp32"], "fp8": flops["bf16"]}
    grouped = {"bf16": grouped_gemm_flops(repeats=repeats)}
    src = torch.randn(copy_mib << 18)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.nbytes / _median_seconds(lambda: dst.copy_(src), repeats)
    counter = _KernelCount()
    with counter:
        _tiny_graph()
    launch = _median_seconds(_tiny_graph, repeats) / counter.kernels
    compute = {f"gemm_{unit}": value for unit, value in flops.items()}
    compute |= {f"gemm_{unit}_backward": value for unit, value in backward.items()}
    compute["grouped_gemm_bf16"] = grouped["bf16"]
    links = Links(1e9, 1e9, 1e9, 1e9, nics_per_node=1, gpus_per_node=1, pcie=bandwidth)
    return Peaks("cpu", compute, bandwidth, launch, links, peak_bf16=flops["bf16"])


def describe_peaks(p: Peaks) -> str:
    return (
        f"cpu peaks ({torch.get_num_threads()} thread): fp32 matmul {p.compute['gemm_fp32'] / 1e9:,.1f} "
        f"GFLOP/s (backward {p.compute['gemm_fp32_backward'] / 1e9:,.1f}), bf16 matmul "
        f"{p.compute['gemm_bf16'] / 1e9:,.1f} GFLOP/s (backward "
        f"{p.compute['gemm_bf16_backward'] / 1e9:,.1f}), bf16 grouped GEMM (fwd + bwd) "
        f"{p.compute['grouped_gemm_bf16'] / 1e9:,.1f} GFLOP/s, copy {p.memory / 1e9:,.2f} GB/s, "
        f"one eager op in the model's step {p.launch_s * 1e6:,.1f} us"
    )


@dataclass
class Check:
    """One model's step at one length: predicted and measured seconds, the costliest op classes."""

    model: str
    tokens: int
    predicted_s: float
    measured_s: float
    top: list[dict]
    split: dict[str, float] = dataclasses.field(default_factory=dict)  # `split`

    @property
    def ratio(self) -> float:
        return self.predicted_s / self.measured_s

    @property
    def ok(self) -> bool:
        return abs(self.ratio - 1) <= TOLERANCE


def _costed(trace: StepTrace, tokens: int, peaks: Peaks) -> list[roofline.CostedClass]:
    return roofline.project(
        trace.ops, trace.ops, tokens, tokens, tokens, dict.fromkeys(trace.ops, 1.0), peaks
    )


def eager_op_seconds(model: str, tokens: int = CALIBRATION_TOKENS, repeats: int = 3) -> float:
    """The cost of one eager op in `model`'s own step: its step at `tokens` (so few that data costs little),
    less its ops' roofline bodies, over its kernels (median of `repeats`). The tiny-graph launch of
    `cpu_peaks` misses what the model's Python, module hooks, autocast and checkpointing add to each op."""
    run = TrainConfig.from_args([f"model={model}", f"seq={tokens}", "offload=false", *CPU_PATHS])
    trace = trace_step(run, ModelConfig.preset(model), tokens, fake=True)
    kernels = sum(op.count for part in trace.ops.values() for op in part.values())
    per_op = []
    with real_step(run, ModelConfig.preset(model), tokens) as step:
        step()
        for _ in range(repeats):
            peaks = dataclasses.replace(cpu_peaks(repeats=repeats), launch_s=0.0)
            body = sum(c.seconds for c in _costed(trace, tokens, peaks))
            per_op.append(max(step() - body, 0.0) / kernels)
    return statistics.median(per_op)


def check(model: str, tokens: int, repeats: int = 3) -> Check:
    """`model` (a preset) at `tokens`: the roofline of the fake trace's op list (every layer traced, the
    update included) with this CPU's peaks and the model's eager op cost (`eager_op_seconds`) against real
    steps, each step right after its own measure of the peaks (the machine is shared: its speed drifts);
    the medians of `repeats` (the peaks' too)."""
    run = TrainConfig.from_args([f"model={model}", f"seq={tokens}", "offload=false", *CPU_PATHS])
    config = ModelConfig.preset(model)
    trace = trace_step(run, config, tokens, fake=True)
    launch = eager_op_seconds(model, repeats=repeats)
    predicted, measured, classes = [], [], []
    with real_step(run, config, tokens) as step:
        step()
        for _ in range(repeats):
            peaks = dataclasses.replace(cpu_peaks(repeats=repeats), launch_s=launch)
            classes = _costed(trace, tokens, peaks)
            predicted.append(sum(c.seconds for c in classes))
            measured.append(step())
    print(describe_peaks(peaks))
    total = statistics.median(predicted)
    check = Check(
        model, tokens, total, statistics.median(measured), roofline.top_classes(classes, total, peaks, 5)
    )
    check.split = split(classes, peaks)
    return check


def split(classes: list[roofline.CostedClass], peaks: Peaks) -> dict[str, float]:
    """Seconds of the prediction by term: the launches (count x the eager op cost), and the bodies of the
    compute-bound and of the memory-bound classes."""
    launch = sum(c.count for c in classes) * peaks.launch_s
    body = {"compute": 0.0, "memory": 0.0}
    for c in classes:
        body["compute" if c.bound == "compute" else "memory"] += c.seconds - c.count * peaks.launch_s
    return {"launch": launch} | body


def _tokens(text: str) -> int:
    return int(text.removesuffix("k")) * 1024 if text.endswith("k") else int(text)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=list(CASES), help="model:tokens cases (tiny:4k ...)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if any(os.environ.get(k) != v for k, v in CPU_MALLOC.items()):  # glibc reads them at start only
        os.execve(sys.executable, [sys.executable, __file__, *argv], os.environ | CPU_MALLOC)
    torch.set_num_threads(1)
    print(
        "The eager op cost is a measured machine constant, like the peaks: calibrated once per model on its\n"
        f"own step at {CALIBRATION_TOKENS} tokens. At 4k and 16k the prediction extrapolates from it: the\n"
        "launch / compute / memory columns give each term's share of the predicted seconds."
    )
    print(
        f"{'model':<6} {'tokens':>7} {'predicted s':>12} {'measured s':>11} {'ratio':>6} "
        f"{'launch':>7} {'compute':>8} {'memory':>7}  top op class"
    )
    last = None
    for case in args.only:
        model, tokens = case.split(":")
        last = check(model, _tokens(tokens), args.repeats)
        top = last.top[0]
        share = {k: v / last.predicted_s for k, v in last.split.items()}
        print(
            f"{last.model:<6} {last.tokens:>7} {last.predicted_s:>12.3f} {last.measured_s:>11.3f} "
            f"{last.ratio:>6.2f} {share['launch']:>7.0%} {share['compute']:>8.0%} {share['memory']:>7.0%}  "
            f"{top['class']} ({top['share']:.0%}, {top['bound']})"
        )
    assert last is not None
    print(f"predicted {last.predicted_s:.3f} s, measured {last.measured_s:.3f} s, ratio {last.ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
