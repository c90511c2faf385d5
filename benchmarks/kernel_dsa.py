"""The sparse MLA Triton kernels (`genomelm.model.dsa_triton`) against the torch sparse path, one DSA layer's
core at GLM-5.3-Flash's full width.

    python benchmarks/kernel_dsa.py --tokens 32768 65536   # one CUDA GPU: a table row per length
    python benchmarks/kernel_dsa.py --cpu-smoke            # tiny shapes, fp32, Triton's interpreter

`check(tokens, device)` (called by gpu_check.py) draws, for one row of `tokens` queries, bf16 absorbed
queries q_lat [1, n, 64, 512] and a latent [1, n, 512], and a selection of 512 distinct visible pools of 4
per query (every visible pool below 2,048 tokens, then one random pool from each of 512 equal bins) plus the
3-token tail: 2,051 slots. It runs forward + backward (a fixed random output gradient) on the torch path
(`dsa_sparse.sparse_latent_attention`, query blocks of `RunOptions.attention_query_block`) and on the
kernels, and reports the best of 3 timed runs after a warm-up, each path's peak memory above its inputs,
and the max |kernel - torch| of out_lat, d q_lat, d latent and the pool mass, each over the largest
|torch| value. The torch path rounds the scores and each block's partial gradients to bf16 while the
kernels keep them in fp32, so `ok` asks for every error <= 2e-2 (a few bf16 ulps of the largest value).
`kernel_tflops`: the kernels' FLOPs (their formulas, forward + backward: 14 x n H W L) over the kernel's
forward + backward time.

`--compile-only` compiles every kernel ahead of time for sm_90 at full width with the GPU tiles (no GPU
needed, not under the interpreter) and prints each one's registers, spilled bytes and shared memory.

The kernels' GPU tiles are not yet timed: on CUDA `check` runs each pair of `TILE_CANDIDATES` (the first is
the module's default) and reports the fastest within tolerance (`tiles`), every pair's time or resource
error in `tiles_tried`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
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
from genomelm.model.dsa_sparse import sparse_latent_attention
from genomelm.model.indexer import Selection

TOLERANCE = 2e-2
SHARED_LIMIT = 227 * 1024  # bytes of shared memory a block may use on an H100 / H200 (sm_90)
# (forward, backward) launch configurations: (heads per program, slots per tile, warps, stages); the first is
# the module's default, the others compile without spills too (--compile-only) or spill a little (64 heads)
TILE_CANDIDATES = [
    ((32, 32, 8, 2), (32, 16, 8, 1)),
    ((64, 32, 8, 2), (16, 16, 8, 1)),
    ((16, 32, 4, 2), (16, 16, 8, 1)),
]


def selection_for(tokens: int, pools_per_query: int, kpool: int, device: torch.device) -> Selection:
    """K distinct visible complete pools per query: all of them while fewer than K are visible (-1 pads
    the rest), else one uniform pool in each of K equal integer bins of the visible ones."""
    gen = torch.Generator(device=device).manual_seed(2)
    visible = (torch.arange(tokens, device=device) + 1) // kpool  # [n] complete pools before each query
    slot = torch.arange(pools_per_query, device=device)
    low = (slot * visible[:, None]) // pools_per_query
    high = ((slot + 1) * visible[:, None]) // pools_per_query
    drawn = low + (torch.rand(tokens, pools_per_query, device=device, generator=gen) * (high - low)).long()
    pools = torch.where(
        visible[:, None] >= pools_per_query, drawn, torch.where(slot < visible[:, None], slot, -1)
    )
    return Selection(pools.to(torch.int32)[None], kpool, True)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float]:
    """(best wall time in ms over `repeats` runs after one warm-up, peak memory in GiB above the start)."""
    fn()
    best = float("inf")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - begin)
    peak = torch.cuda.max_memory_allocated(device) - start if device.type == "cuda" else 0
    return best * 1e3, peak / 2**30


def max_rel_error(got: Tensor, expected: Tensor) -> float:
    return float((got.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-30))


def check(tokens: int, device: torch.device, smoke: bool = False) -> dict:
    """One row: the kernels against the torch path at `tokens` queries (module docstring). bf16 on CUDA,
    fp32 on the CPU (the interpreter's bf16 loads are wrong); `smoke`: 16 heads, latent 32, top-32. On CUDA
    every pair of `TILE_CANDIDATES` runs; the row is the fastest within tolerance, with each pair's time
    (or its resource error) in `tiles`."""
    from triton.runtime.errors import OutOfResources

    from genomelm.model import dsa_triton_common as tiling
    from genomelm.model.dsa_triton import sparse_mla

    config = ModelConfig.preset("glm-5.3-flash")
    heads, width = (16, 32) if smoke else (config.num_attention_heads, config.kv_lora_rank)
    kpool = config.index_kpool
    pools_per_query = (32 if smoke else config.index_topk) // kpool
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    scaling = config.qk_head_dim**-0.5
    block = RunOptions().attention_query_block
    gen = torch.Generator(device=device).manual_seed(1)
    q_lat = torch.randn(1, tokens, heads, width, device=device, dtype=dtype, generator=gen).requires_grad_()
    latent = torch.randn(1, tokens, width, device=device, dtype=dtype, generator=gen).requires_grad_()
    grad = torch.randn(1, tokens, heads, width, device=device, dtype=dtype, generator=gen)
    selection = selection_for(tokens, pools_per_query, kpool, device)
    positions = torch.arange(tokens, device=device)

    def torch_path() -> tuple[Tensor, ...]:
        q_lat.grad = latent.grad = None
        out, _ = sparse_latent_attention(q_lat, latent, selection, scaling, block, False)
        out.backward(grad)
        return out.detach(), q_lat.grad, latent.grad

    def kernel_path() -> tuple[Tensor, ...]:
        q_lat.grad = latent.grad = None
        out, _ = sparse_mla(q_lat, latent, selection.pools, positions, kpool, True, scaling, False)
        out.backward(grad)
        return out.detach(), q_lat.grad, latent.grad

    repeats = 3 if device.type == "cuda" else 1
    torch_ms, torch_peak = timed(torch_path, device, repeats)
    expected = torch_path()
    with torch.no_grad():
        _, mass_expected = sparse_latent_attention(q_lat, latent, selection, scaling, block, True)

    def measure() -> dict:
        kernel_ms, kernel_peak = timed(kernel_path, device, repeats)
        with FlopCounterMode(display=False) as counter:
            got = kernel_path()
        errors = {name: max_rel_error(a, b) for name, a, b in zip(("out", "d q", "d latent"), got, expected)}
        with torch.no_grad():
            _, mass = sparse_mla(q_lat, latent, selection.pools, positions, kpool, True, scaling, True)
        errors["pool mass"] = max_rel_error(mass, mass_expected)
        counts = counter.get_flop_counts()["Global"]
        flops = counts.get(torch.ops.genomelm.sparse_mla_fwd, 0) + counts.get(
            torch.ops.genomelm.sparse_mla_bwd, 0
        )
        worst = max(errors.values())
        return {
            "name": "dsa sparse MLA (triton fwd + bwd)",
            "tokens": tokens,
            "max_rel_error": worst,
            "errors": errors,
            "torch_ms": torch_ms,
            "kernel_ms": kernel_ms,
            "speedup": torch_ms / kernel_ms,
            "kernel_tflops": flops / (kernel_ms * 1e-3) / 1e12,
            "torch_peak_gib": torch_peak,
            "kernel_peak_gib": kernel_peak,
            "ok": worst <= TOLERANCE,
        }

    if device.type != "cuda":
        return measure()
    rows, tried = [], {}
    defaults = tiling.FORWARD_TILES, tiling.BACKWARD_TILES
    try:
        for forward, backward in TILE_CANDIDATES:  # `tiles()` reads them at each launch
            tiling.FORWARD_TILES = tiling.Tiles(*forward)
            tiling.BACKWARD_TILES = tiling.Tiles(*backward)
            key = f"forward {forward}, backward {backward}"
            try:
                rows.append(measure() | {"tiles": key})
                tried[key] = f"{rows[-1]['kernel_ms']:.1f} ms, error {rows[-1]['max_rel_error']:.1e}"
            except OutOfResources as error:
                tried[key] = str(error)
    finally:
        tiling.FORWARD_TILES, tiling.BACKWARD_TILES = defaults
    if not rows:
        raise RuntimeError(f"no tile configuration ran: {tried}")
    best = min(rows, key=lambda row: (not row["ok"], row["kernel_ms"]))
    return best | {"tiles_tried": tried}


def compile_report(capability: int = 90) -> list[dict]:
    """Compile each kernel for an sm_`capability` GPU with the current GPU tiles at GLM-5.3-Flash's shapes
    (bf16, latent 512, kpool 4, ints divisible by 16 as the JIT specialises them at full width): one dict
    per kernel with `registers` (per thread), `spilled` (stack bytes per thread) and `shared` (bytes)."""
    import subprocess
    import tempfile

    import triton
    import triton.backends.nvidia
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from genomelm.model import dsa_triton as k
    from genomelm.model import dsa_triton_common as tiling
    from genomelm.model import dsa_triton_mass as mass

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("--compile-only compiles for a GPU: unset TRITON_INTERPRET")
    forward, backward = tiling.FORWARD_TILES, tiling.BACKWARD_TILES
    common = {"pools_ptr": "*i32", "positions_ptr": "*i64", "lse_ptr": "*fp32", "mass_ptr": "*fp32"}
    common |= {"grad_latent_ptr": "*fp32", "parts_ptr": "*fp32", "order_ptr": "*i64", "offsets_ptr": "*i64"}
    common |= {"qk_scale": "fp32", "scaling": "fp32", "stride_qb": "i64"}
    shapes = {"KPOOL": 4, "TAIL": True, "BLOCK_L": 512, "DOT": "tf32"}
    kernels = [
        ("forward", k._fwd_kernel, forward, {}),
        ("backward", k._bwd_kernel, backward, {"DETERMINISTIC": False}),
        ("backward, deterministic", k._bwd_kernel, backward, {"DETERMINISTIC": True}),
        ("pool mass", mass._pool_mass_kernel, forward, {}),
        ("fixed-order reduction", k._reduce_rows_kernel, forward, {}),
    ]
    cuobjdump = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    report = []
    for name, fn, tile, extra in kernels:
        constants = shapes | extra | {"BLOCK_H": tile.block_h, "BLOCK_W": tile.block_w}
        constants = {n: v for n, v in constants.items() if n in fn.arg_names}
        signature, attrs = {}, {}
        for index, arg in enumerate(fn.arg_names):
            if arg in constants:
                signature[arg] = "constexpr"
                continue
            signature[arg] = common.get(arg, "*bf16" if arg.endswith("_ptr") else "i32")
            if signature[arg] != "fp32" and arg != "W":  # W = 2,051 slots is the one odd int
                attrs[(index,)] = [["tt.divisibility", 16]]
        options = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
        compiled = triton.compile(
            ASTSource(fn, signature, constants, attrs),
            target=GPUTarget("cuda", capability, 32),
            options=options,
        )
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run(
                [str(cuobjdump), "--dump-resource-usage", cubin.name],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        fields = dict(re.findall(r"(REG|STACK):(\d+)", usage))
        report.append(
            {
                "name": name,
                "tiles": dataclasses.astuple(tile),
                "registers": int(fields["REG"]),
                "spilled": int(fields["STACK"]),
                "shared": compiled.metadata.shared,
            }
        )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, fp32, under the interpreter")
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90, print resource use")
    args = parser.parse_args()
    if args.compile_only:
        for row in compile_report():
            fits = row["spilled"] == 0 and row["shared"] <= SHARED_LIMIT
            print(
                f"{row['name']:<24} tiles {row['tiles']}: {row['registers']} registers, {row['spilled']} B "
                f"spilled, {row['shared'] / 1024:.0f} KiB shared{'' if fits else '  <- does not fit'}"
            )
        return
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    lengths = [61] if args.cpu_smoke else args.tokens
    print(
        f"{'name':<34} {'tokens':>7} {'max err':>9} {'torch ms':>10} {'kernel ms':>10} {'speedup':>8} "
        f"{'TFLOP/s':>8} {'ok':>3}"
    )
    for tokens in lengths:
        row = check(tokens, device, smoke=args.cpu_smoke)
        print(
            f"{row['name']:<34} {row['tokens']:>7} {row['max_rel_error']:>9.2e} {row['torch_ms']:>10.1f} "
            f"{row['kernel_ms']:>10.1f} {row['speedup']:>8.2f} {row['kernel_tflops']:>8.3f} {row['ok']!s:>3}"
        )
        print("  errors: " + ", ".join(f"{k} {v:.2e}" for k, v in row["errors"].items()))
        if "tiles" in row:
            print(f"  fastest tiles: {row['tiles']}; tried: {row['tiles_tried']}")
        if device.type == "cuda":
            print(
                f"  peak above inputs: torch {row['torch_peak_gib']:.2f} GiB, "
                f"kernel {row['kernel_peak_gib']:.2f} GiB"
            )


if __name__ == "__main__":
    main()
