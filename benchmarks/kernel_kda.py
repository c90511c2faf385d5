"""KDA on fla against the torch path: one layer's delta rule at GLM-5.3-Flash width (64 heads x 128).

Four comparisons, each forward and backward from fixed random output and final-state gradients, all on the
same bf16 q/k/v/beta and fp32 gates built by our gate formula from random projections:
1. `chunk_kda`: fla fed bf16 q/k/v (`kda_chunk.fla_kda`, as the model calls it) against the torch chunked path
   (`chunk_kda_torch`, fp32 with its fp64 solve) on the same values; the times of these two are the row's.
2. In-kernel gate: fla with `use_gate_in_kernel=True` on the raw gate input, A_log, dt_bias and the lower
   bound -5 against fla on our `ForgetGate` formula's g (the same kernel otherwise): output, state and the
   gradients of the raw input, A_log and dt_bias.
3. Short conv: fla's `causal_conv1d` with the halo as its initial state (`kda.fla_depthwise_conv`) against
   `kda.causal_depthwise_conv` + SiLU in fp32, on bf16 rows [1, tokens, 3 x 64 x 128] and a random halo:
   output and the gradients of rows, weight and halo.
4. Context parallelism on one GPU: the window cut into the four segments of zigzag cp=2, each summarised on
   fla (`fla_segment_summary`), the states folded in global order (`apply_state_map`, as
   `hand_over_states` does) and fla's core run from each segment's incoming state (what each rank runs),
   against the one-piece fla run.
Errors are ||ours - reference|| / ||reference|| per output and gradient, the worst reported.

Tolerance (`TOLERANCE`): both sides of 1 see the same bf16 inputs; fla rounds its intermediate w, u, the
per-chunk states and the output to bf16 (2^-8 of an entry each) where the torch path keeps fp32, which puts
norm-wise errors near 1e-2 at 64k tokens: 2e-2. 2 and 4 compare fla with fla, 3 rounds fla's output to bf16
once (ours stays fp32 until q/k/v are cast); all use the same bound.

`check(tokens, device)` is called by `benchmarks/gpu_check.py`. `--cpu-smoke` cannot run fla (its kernels
do not run on the CPU, not even under Triton's interpreter): it runs the CPU-checkable pieces at tiny fp32
shapes (the gate formula against `ForgetGate`, the packed summary and the fold against the one-piece torch
path) and says that the rest is skipped.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from genomelm.model.kda import causal_depthwise_conv, fla_depthwise_conv
from genomelm.model.kda_chunk import (
    FlaGate,
    apply_state_map,
    chunk_kda_flops,
    chunk_kda_torch,
    fla_chunk_kda,
    fla_gate_reference,
    fla_kda,
    fla_segment_summary,
    kda_chunk_transforms,
    kda_segment_summary,
)

TOLERANCE = 2e-2  # norm-wise relative error, bf16 inputs
SMOKE_TOLERANCE = 1e-5  # fp32 on the CPU: summation order only
HEADS, HEAD_DIM, LOWER_BOUND, CHUNK = 64, 128, -5.0, 64
ZIGZAG_CP2_SEGMENTS = 4
REPEATS = 3


class Inputs:
    """One layer's delta-rule inputs: q, k, v, beta in `dtype`, the raw gate input f (`dtype`), A_log [H] and
    dt_bias [H*Dk] (fp32), g from our gate formula (fp32), an fp32 initial state, and the fixed gradients."""

    def __init__(self, tokens: int, heads: int, dim: int, device: torch.device, dtype: torch.dtype) -> None:
        gen = torch.Generator(device).manual_seed(0)

        def randn(*shape: int, dtype: torch.dtype = dtype) -> Tensor:
            return torch.randn(*shape, device=device, generator=gen, dtype=dtype)

        self.q, self.k, self.v = (randn(1, tokens, heads, dim) for _ in range(3))
        self.beta = torch.sigmoid(randn(1, tokens, heads))
        self.raw = randn(1, tokens, heads, dim)
        self.A_log = 0.3 * randn(heads, dtype=torch.float32)
        self.dt_bias = -4.0 + randn(heads * dim, dtype=torch.float32)  # slow decays: states cross segments
        self.gate = FlaGate(self.A_log, self.dt_bias, LOWER_BOUND)
        self.g = fla_gate_reference(self.raw, self.gate)
        self.state = 0.1 * randn(1, heads, dim, dim, dtype=torch.float32)
        self.grad_out = randn(1, tokens, heads, dim, dtype=torch.float32)
        self.grad_state = randn(1, heads, dim, dim, dtype=torch.float32)


def _leaves(*tensors: Tensor) -> list[Tensor]:
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _backward(out: Tensor, state: Tensor, inputs: Inputs, leaves: list[Tensor]) -> list[Tensor]:
    """Outputs and the leaves' gradients of sum(out * grad_out) + sum(state * grad_state)."""
    loss = (out.float() * inputs.grad_out).sum() + (state.float() * inputs.grad_state).sum()
    grads = torch.autograd.grad(loss, leaves)
    return [out.detach().float(), state.detach().float(), *(g.float() for g in grads)]


def torch_step(inputs: Inputs) -> list[Tensor]:
    """The torch chunked path (fp32, fp64 solve) on the inputs' values: out, state, dq, dk, dv, dg, dbeta,
    d state."""
    leaves = _leaves(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.state)
    q, k, v, g, beta, state = (t.float() for t in leaves)
    out, final = chunk_kda_torch(q, k, v, g, beta, state, CHUNK, -LOWER_BOUND)
    return _backward(out, final, inputs, leaves)


def fla_step(inputs: Inputs) -> list[Tensor]:
    """fla's `chunk_kda` as the model calls it, on the same values: as `torch_step`."""
    leaves = _leaves(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.state)
    out, final = fla_kda(*leaves, -LOWER_BOUND)
    return _backward(out, final, inputs, leaves)


def gate_steps(inputs: Inputs) -> tuple[list[Tensor], list[Tensor]]:
    """fla with its in-kernel gate, and fla on our gate formula: out, state, d raw, d A_log, d dt_bias."""
    results = []
    for in_kernel in (True, False):
        raw, A_log, dt_bias = _leaves(inputs.raw, inputs.A_log, inputs.dt_bias)
        gate = FlaGate(A_log, dt_bias, LOWER_BOUND)
        g = raw if in_kernel else fla_gate_reference(raw, gate)
        kernel_gate = gate if in_kernel else None
        q, k, v, beta, state = inputs.q, inputs.k, inputs.v, inputs.beta, inputs.state
        out, final = fla_kda(q, k, v, g, beta, state, -LOWER_BOUND, kernel_gate)
        results.append(_backward(out, final, inputs, [raw, A_log, dt_bias]))
    return results[0], results[1]


def conv_steps(tokens: int, channels: int, device: torch.device) -> tuple[list[Tensor], list[Tensor]]:
    """fla's conv and ours on the same bf16 rows [1, tokens, channels], halo [1, 3, channels] and fp32
    weight [channels, 1, 4]: output, d rows, d weight, d halo of each."""
    gen = torch.Generator(device).manual_seed(2)
    rows = torch.randn(1, tokens, channels, device=device, generator=gen).bfloat16()
    halo = torch.randn(1, 3, channels, device=device, generator=gen).bfloat16()
    weight = 0.5 * torch.randn(channels, 1, 4, device=device, generator=gen)
    grad = torch.randn(1, tokens, channels, device=device, generator=gen)
    results = []
    for fla in (True, False):
        leaves = _leaves(rows, weight, halo)
        r, w, h = leaves
        if fla:
            out = fla_depthwise_conv(r, h, w)
        else:
            out = F.silu(causal_depthwise_conv(torch.cat([h, r], dim=1).float(), w))
        grads = torch.autograd.grad((out.float() * grad).sum(), leaves)
        results.append([out.detach().float(), *(g.float() for g in grads)])
    return results[0], results[1]


def segment_steps(
    inputs: Inputs, core: Callable[..., tuple[Tensor, Tensor]], summary: Callable[..., Tensor]
) -> tuple[list[Tensor], list[Tensor]]:
    """The window in zigzag cp=2's four segments (summaries, fold, each segment's core from its incoming
    state) and in one piece, both through `core(q, k, v, g, beta, state)` and `summary(q, k, v, g, beta)`:
    out, state, dq, dk, dv, dg, dbeta, d state of each."""
    results = []
    for pieces in (ZIGZAG_CP2_SEGMENTS, 1):
        leaves = _leaves(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.state)
        *per_token, state = leaves
        rows = [t.unflatten(1, (pieces, -1)).transpose(0, 1).flatten(0, 1) for t in per_token]  # segments
        if pieces == 1:
            out, final = core(*rows, state)
        else:
            maps = summary(*rows)  # [n, H, Dk, Dk+Dv]: one segment per batch row, as a rank's rows
            incoming = [state]
            for segment_map in maps.unsqueeze(1):
                incoming.append(apply_state_map(segment_map, incoming[-1]))
            out, _ = core(*rows, torch.cat(incoming[:-1]))
            out, final = out.flatten(0, 1).unsqueeze(0), incoming[-1]
        results.append(_backward(out, final, inputs, leaves))
    return results[0], results[1]


def relative_errors(ours: list[Tensor], reference: list[Tensor], names: list[str]) -> dict[str, float]:
    return {
        name: float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
        for name, a, b in zip(names, ours, reference, strict=True)
    }


def _milliseconds(fn: Callable[[], object], device: torch.device) -> float:
    fn()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(REPEATS):
        fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / REPEATS * 1e3


CORE_NAMES = ["output", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial state"]
CONV_NAMES = ["conv: output", "conv: d rows", "conv: d weight", "conv: d halo"]
GATE_NAMES = ["gate: output", "gate: final state", "gate: d raw", "gate: d A_log", "gate: d dt_bias"]


def check(tokens: int, device: torch.device, smoke: bool = False) -> dict:
    """fla's KDA at 64 heads x 128 and `tokens` tokens against the torch path, the in-kernel gate against
    ours, and the zigzag cp=2 segments against one piece (all bf16 q/k/v); `smoke`: `cpu_smoke` (what runs
    without fla, at its own tiny size)."""
    if smoke:
        return cpu_smoke()
    if fla_chunk_kda() is None:
        raise RuntimeError("fla-core is not installed: pip install -e '.[gpu]'")
    inputs = Inputs(tokens, HEADS, HEAD_DIM, device, torch.bfloat16)
    errors = relative_errors(fla_step(inputs), torch_step(inputs), CORE_NAMES)
    errors |= relative_errors(*gate_steps(inputs), GATE_NAMES)
    errors |= relative_errors(*conv_steps(tokens, 3 * HEADS * HEAD_DIM, device), CONV_NAMES)

    def fla_core(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor):
        return fla_kda(q, k, v, g, beta, state, -LOWER_BOUND)

    def fla_summary(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        return fla_segment_summary(q, k, v, g, beta, -LOWER_BOUND, None)

    segments = relative_errors(*segment_steps(inputs, fla_core, fla_summary), CORE_NAMES)
    errors |= {f"cp2: {name}": error for name, error in segments.items()}
    torch_ms = _milliseconds(lambda: torch_step(inputs), device)
    kernel_ms = _milliseconds(lambda: fla_step(inputs), device)
    flops = 3 * chunk_kda_flops(1, tokens, HEADS, HEAD_DIM, HEAD_DIM)  # forward + a backward of ~2x
    worst = max(errors, key=errors.get)
    return {
        "name": "kda fla chunk_kda (bf16 q/k/v; gate in kernel; conv; cp=2 segments; fwd + bwd)",
        "tokens": tokens,
        "max_rel_error": errors[worst],
        "worst": worst,
        "errors": errors,
        "torch_ms": torch_ms,
        "kernel_ms": kernel_ms,
        "speedup": torch_ms / kernel_ms,
        "kernel_tflops": flops / (kernel_ms * 1e-3) / 1e12,
        "ok": errors[worst] < TOLERANCE,
    }


def cpu_smoke() -> dict:
    """What runs without fla, in fp32 at tiny shapes: the gate formula fla's kernel applies against
    `ForgetGate`'s, the packed summary (the torch path standing in for fla's `chunk_kda`) against the torch
    summary, and the zigzag cp=2 fold against the one-piece torch path. fla itself: skipped."""
    from genomelm.model import ModelConfig
    from genomelm.model.kda import ForgetGate

    config = ModelConfig.preset("tiny")
    forget_gate = ForgetGate(config)
    with torch.no_grad():
        for parameter in forget_gate.parameters():
            parameter.normal_(0.0, 0.3)
    x = torch.randn(1, 64, config.hidden_size)
    heads, dim = config.linear_num_heads, config.linear_head_dim
    inputs = Inputs(64, heads, dim, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        theirs = fla_gate_reference(forget_gate.raw(x), forget_gate.fla_gate())
        errors = relative_errors([theirs], [forget_gate(x)], ["gate formula"])

    def torch_core(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor):
        return chunk_kda_torch(q, k, v, g, beta, state, 16, -LOWER_BOUND)

    def packed_summary(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        """`fla_segment_summary`'s one call, [0 | v] from [I | 0], on the torch path."""
        batch, _, heads, dk = k.shape
        start = F.pad(torch.eye(dk).expand(batch, heads, dk, dk), (0, v.shape[-1]))
        return torch_core(q, k, F.pad(v, (dk, 0)), g, beta, start)[1]

    with torch.no_grad():
        per_token = (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)
        direct = kda_segment_summary(kda_chunk_transforms(*per_token, 16, -LOWER_BOUND, with_queries=False))
        errors |= relative_errors([packed_summary(*per_token)], [direct], ["packed summary"])
    segments = relative_errors(*segment_steps(inputs, torch_core, packed_summary), CORE_NAMES)
    errors |= {f"cp2: {name}": error for name, error in segments.items()}
    worst = max(errors, key=errors.get)
    return {
        "name": "kda cpu smoke (gate formula, packed summary, cp=2 fold; fla kernels skipped: no GPU)",
        "tokens": 64,
        "max_rel_error": errors[worst],
        "worst": worst,
        "errors": errors,
        "ok": errors[worst] < SMOKE_TOLERANCE,
    }


HEADER = "| check | tokens | max rel error (worst) | torch ms | kernel ms | speedup | kernel TFLOP/s | ok |"


def row(result: dict) -> str:
    """One Markdown table row of a `check` (or `cpu_smoke`) result."""

    def number(key: str, form: str) -> str:
        return format(result[key], form) if key in result else "skipped"

    return (
        f"| {result['name']} | {result['tokens']} | {result['max_rel_error']:.2e} ({result['worst']}) | "
        f"{number('torch_ms', '.2f')} | {number('kernel_ms', '.2f')} | {number('speedup', '.2f')} | "
        f"{number('kernel_tflops', '.1f')} | {result['ok']} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="the CPU-checkable pieces, tiny fp32 shapes")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536])
    args = parser.parse_args(argv)
    rows = [cpu_smoke()] if args.cpu_smoke else [check(t, torch.device("cuda")) for t in args.tokens]
    print(HEADER)
    print("|---" * 8 + "|")
    for result in rows:
        print(row(result))
    return 0 if all(result["ok"] for result in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
