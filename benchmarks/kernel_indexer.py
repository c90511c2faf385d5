"""The Triton lightning indexer against its torch path, and FP8 against bf16 selections on real DNA.

    python benchmarks/kernel_indexer.py --tokens 32768 65536   # one CUDA GPU: a table row per length
    python benchmarks/kernel_indexer.py --cpu-smoke            # tiny shapes, fp32, Triton's interpreter
    python benchmarks/kernel_indexer.py --fp8-overlap          # FP8 vs bf16 selections, `small`, fly chr4

`check(tokens, device)` (called by gpu_check.py) builds one GLM-5.3-Flash indexer at full width (32 index
heads x 128, q_lora 1536, hidden 4096, top-2048 tokens in pools of 4) with random weights, and on the same
bf16 inputs runs `Indexer.select` on the torch path and on the kernel path (the pooled keys computed once,
outside the timing). Errors: the kernel's fp32 index scores against `Indexer._block_scores` on the last
128 queries (the widest rows), max |difference| over the visible pools relative to the largest |score|;
and the selection overlap (the fraction of selected pools both paths select). Both score the same bf16
q and keys with fp32 accumulation, so the scores differ only by summation order (~1e-6): `ok` asks for a
relative error <= 2^-8 (one bf16 ulp) and an overlap >= 0.99 (ulp-level near-ties at the K-th place may
swap). Peak memory: what one select adds over its inputs (the selection [1, S, 512] int32 included).
select takes no gradient: there are none to compare. On Hopper and newer it also scores with FP8.
`kernel_tflops`: the fused scores' FLOPs (its formula) over the whole kernel-path select time (projections
and top-k included), a lower bound on the kernel's own rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from genomelm.model import ModelConfig, RunOptions
from genomelm.model.indexer import Indexer, Selection

GENOME = Path(__file__).resolve().parents[1] / "data" / "dmel_chr4.fa.gz"
SCORE_TOLERANCE = 2.0**-8
OVERLAP_TOLERANCE = 0.99


def indexer_config(smoke: bool) -> ModelConfig:
    """GLM-5.3-Flash's indexer shapes, or tiny ones for the CPU smoke (4 heads x 16, top-32)."""
    base = ModelConfig.preset("glm-5.3-flash")
    if not smoke:
        return base
    return dataclasses.replace(
        base, hidden_size=64, q_lora_rank=32, index_n_heads=4, index_head_dim=16, index_topk=32
    )


def indexer_pair(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> tuple[Indexer, Indexer]:
    """(torch path, kernel path) indexers with the same random weights (the pool gate and position terms,
    zero at init, drawn too)."""
    torch.manual_seed(0)
    reference = Indexer(config, RunOptions(indexer_backend="torch"))
    with torch.no_grad():
        reference.index_kpool_compress_gate.normal_(0.0, config.hidden_size**-0.5)
        reference.index_kpool_compress_ape.normal_(0.0, 0.1)
    kernel = Indexer(config, RunOptions(indexer_backend="triton"))
    kernel.load_state_dict(reference.state_dict())
    return reference.to(device, dtype), kernel.to(device, dtype)


def timed(fn: Callable[[], Selection], device: torch.device, repeats: int) -> tuple[float, float, Selection]:
    """(best wall time in ms over `repeats` runs after one warm-up, the peak memory the call adds in MiB on
    CUDA (0 elsewhere), the last result)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    result = fn()
    peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20 if device.type == "cuda" else 0.0
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - begin)
    return best * 1e3, peak, result


def overlap(a: Tensor, b: Tensor) -> float:
    """Fraction of the pools selected in `a` [B, S, K] (valid slots) that `b` selects for the same query."""
    valid = a >= 0
    ranked = b.sort(-1).values.contiguous()
    where = torch.searchsorted(ranked, a.contiguous()).clamp(max=b.shape[-1] - 1)
    found = (ranked.gather(-1, where) == a) & valid
    return float(found.sum()) / max(1, int(valid.sum()))


def score_error(reference: Indexer, kernel: Indexer, x: Tensor, q_resid: Tensor, pool_keys: Tensor) -> float:
    """Max |kernel - torch| index score of the last 128 queries over their visible pools, relative to the
    largest |score|."""
    from genomelm.model.indexer_triton import indexer_scores

    start = max(0, x.shape[1] - 128)
    rows = slice(start, x.shape[1])
    expected = reference._block_scores(x[:, rows], q_resid[:, rows], pool_keys, start)
    q, weights = kernel._block_queries(x[:, rows], q_resid[:, rows])
    got = indexer_scores(
        q.to(pool_keys.dtype), pool_keys, weights, None, start, kernel.kpool, kernel.softmax_scale
    )
    visible = expected > torch.finfo(torch.float32).min
    return float((got - expected)[visible].abs().max() / expected[visible].abs().max().clamp_min(1e-30))


def check(tokens: int, device: torch.device, smoke: bool = False) -> dict:
    """One row: the kernel path of `Indexer.select` against the torch path at `tokens` tokens (module
    docstring). Inputs bf16 on CUDA, fp32 on the CPU (the interpreter's bf16 loads are wrong)."""
    config = indexer_config(smoke)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reference, kernel = indexer_pair(config, device, dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, tokens, config.hidden_size, device=device, dtype=dtype, generator=gen)
    q_resid = torch.randn(1, tokens, config.q_lora_rank, device=device, dtype=dtype, generator=gen)
    repeats = 3 if device.type == "cuda" else 1
    with torch.no_grad():
        pool_keys = reference.pool_keys(x)
        torch_ms, torch_mib, expected = timed(
            lambda: reference.select(x, q_resid, pool_keys), device, repeats
        )
        kernel_ms, kernel_mib, got = timed(lambda: kernel.select(x, q_resid, pool_keys), device, repeats)
        with FlopCounterMode(display=False) as counter:
            kernel.select(x, q_resid, pool_keys)
        error = score_error(reference, kernel, x, q_resid, pool_keys)
    flops = counter.get_flop_counts()["Global"].get(torch.ops.genomelm.indexer_scores, 0)
    same = overlap(got.pools, expected.pools)
    row = {
        "name": "indexer (triton fused scores)",
        "tokens": tokens,
        "max_rel_error": error,
        "selection_overlap": same,
        "torch_ms": torch_ms,
        "kernel_ms": kernel_ms,
        "speedup": torch_ms / kernel_ms,
        "kernel_tflops": flops / (kernel_ms * 1e-3) / 1e12,
        "torch_peak_mib": torch_mib,
        "kernel_peak_mib": kernel_mib,
        "route": kernel.route,
        "ok": error <= SCORE_TOLERANCE and same >= OVERLAP_TOLERANCE,
    }
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0):
        fp8 = Indexer(config, RunOptions(indexer_backend="triton", indexer_precision="fp8"))
        fp8.load_state_dict(kernel.state_dict())
        fp8 = fp8.to(device, dtype)
        with torch.no_grad():
            row["fp8_ms"], row["fp8_peak_mib"], fp8_selection = timed(
                lambda: fp8.select(x, q_resid, pool_keys), device, repeats
            )
        row["fp8_overlap_random"] = overlap(fp8_selection.pools, got.pools)
    return row


def genome_window(length: int, offset: int = 100_000) -> Tensor:
    """`length` bases of the bundled fly chromosome 4 from `offset` as token ids [1, length] (the built-in
    vocabulary: A=1 C=2 G=3 T=4 N=5)."""
    with gzip.open(GENOME, "rt") as handle:
        sequence = "".join(line.strip() for line in handle if not line.startswith(">"))
    codes = {"A": 1, "C": 2, "G": 3, "T": 4}
    window = sequence[offset : offset + length].upper()
    return torch.tensor([[codes.get(base, 5) for base in window]], dtype=torch.long)


def fp8_overlap(tokens: int, backend: str) -> dict:
    """Overlap of FP8 and bf16 selections of every DSA layer of the `small` preset (random init: no trained
    checkpoint is bundled) on `tokens` bases of fly chromosome 4: the inputs of each DSA layer captured from
    a bf16-autocast forward, then `select` with indexer_precision bf16 and fp8 (on the CPU the torch path,
    whose fp8 emulation the kernel matches under the interpreter: tests/test_kernel_indexer.py)."""
    from genomelm.model import GlmForCausalLM
    from genomelm.model.dsa import DSAAttention

    device = torch.device("cuda" if backend == "triton" else "cpu")
    torch.manual_seed(0)
    config = ModelConfig.preset("small")
    model = GlmForCausalLM(config, RunOptions()).to(device)
    inputs: list[Tensor] = []
    layers = [m for m in model.modules() if isinstance(m, DSAAttention) and m.indexer is not None]
    hooks = [m.register_forward_pre_hook(lambda _, args: inputs.append(args[0].detach())) for m in layers]
    ids = genome_window(tokens).to(device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        model.token_logprobs(ids)
    for hook in hooks:
        hook.remove()
    result = {"tokens": tokens, "backend": backend, "overlaps": []}
    for layer, x in zip(layers, inputs[: len(layers)]):
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            q_resid, _, pool_keys = layer.project(x, True)
            selections = {}
            for precision in ("bf16", "fp8"):
                indexer = Indexer(config, RunOptions(indexer_backend=backend, indexer_precision=precision))
                indexer.load_state_dict(layer.indexer.state_dict())
                selections[precision] = indexer.to(device).select(x, q_resid, pool_keys).pools
        result["overlaps"].append(overlap(selections["fp8"], selections["bf16"]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, fp32, under the interpreter")
    parser.add_argument("--fp8-overlap", action="store_true", help="FP8 vs bf16 selections on fly DNA")
    parser.add_argument("--overlap-tokens", type=int, default=16384)
    args = parser.parse_args()
    if args.fp8_overlap:
        backend = "triton" if torch.cuda.is_available() else "torch"
        result = fp8_overlap(args.overlap_tokens, backend)
        layers = ", ".join(f"{value:.4f}" for value in result["overlaps"])
        print(
            f"fp8 vs bf16 selection overlap, small (random init), {result['tokens']} bases of fly chr4, "
            f"{backend} path: per DSA layer {layers}"
        )
        return
    if args.cpu_smoke:
        rows = [check(256, torch.device("cpu"), smoke=True)]
    else:
        rows = [check(tokens, torch.device("cuda")) for tokens in args.tokens]
    print(
        f"{'name':32} {'tokens':>7} {'rel err':>9} {'overlap':>8} {'torch ms':>9} {'kernel ms':>9} "
        f"{'speedup':>7} {'TFLOP/s':>8} ok"
    )
    for row in rows:
        errors = f"{row['max_rel_error']:9.2e} {row['selection_overlap']:8.4f}"
        times = f"{row['torch_ms']:9.1f} {row['kernel_ms']:9.1f} {row['speedup']:7.2f}"
        print(f"{row['name']:32} {row['tokens']:7d} {errors} {times} {row['kernel_tflops']:8.3f} {row['ok']}")
    if not all(row["ok"] for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
