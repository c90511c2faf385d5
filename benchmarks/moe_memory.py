"""Peak memory of one MoE layer's forward + backward as the number of experts grows (active size fixed).

Each case runs in a fresh subprocess: it builds one MoE layer (hidden 256, expert width 128, top-2, one shared
expert) with E routed experts, routes 8,192 tokens of fixed inputs, runs forward + backward, and reports its
peak RSS above what it held before the step plus the parameters' gradients (which any backward must write
once). That excess is the layer's working memory; with the grouped GEMM it should not depend on E. The
readable `loop` backend (one `gate_up_proj[e]` slice per expert, whose backward allocates a zero gradient
the size of the whole parameter per expert) is shown beside it at the sizes where it still fits.

    .venv/bin/python benchmarks/moe_memory.py          # the table (about a minute)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys

import torch

from genomelm.model import ModelConfig, RunOptions
from genomelm.model.moe import MoE

EXPERTS = (8, 64, 288)
TOKENS = 8192
HIDDEN, WIDTH, TOP_K = 256, 128, 2
LOOP_LIMIT = 64  # the loop reference's backward needs E x the parameter: skip it above this


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_case(experts: int, backend: str) -> dict:
    config = dataclasses.replace(
        ModelConfig.preset("tiny"),
        hidden_size=HIDDEN,
        moe_intermediate_size=WIDTH,
        n_routed_experts=experts,
        num_experts_per_tok=TOP_K,
        n_group=1,
        topk_group=1,
    )
    torch.manual_seed(0)
    moe = MoE(config, RunOptions(moe_backend=backend, moe_chunk_tokens=TOKENS))
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0.0, p.shape[-1] ** -0.5)
    x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1), requires_grad=True)
    weight = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(2))
    grad_bytes = sum(p.numel() * p.element_size() for p in moe.parameters())
    before = peak_rss_mb()
    (moe(x) * weight).sum().backward()
    excess = peak_rss_mb() - before - grad_bytes / 2**20
    checksum = float(sum(p.grad.double().abs().sum() for p in moe.parameters()))
    return {
        "experts": experts,
        "backend": backend,
        "param_mb": grad_bytes / 2**20,
        "working_mb": excess,
        "grad_checksum": checksum,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int)
    parser.add_argument("--backend", default="grouped")
    args = parser.parse_args()
    if args.experts is not None:
        print(json.dumps(run_case(args.experts, args.backend)))
        return
    rows = []
    for experts in EXPERTS:
        for backend in ("grouped", "loop"):
            if backend == "loop" and experts > LOOP_LIMIT:
                continue
            out = subprocess.run(
                [sys.executable, __file__, "--experts", str(experts), "--backend", backend],
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = next(r["working_mb"] for r in rows if r["backend"] == "grouped")
    print(
        f"one MoE layer, {TOKENS:,} tokens, hidden {HIDDEN}, expert width {WIDTH}, top-{TOP_K}: "
        "forward + backward"
    )
    print(
        "| experts | backend | parameters MB | working memory MB (peak RSS - before - gradients) "
        "| vs 8 experts |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['experts']} | {r['backend']} | {r['param_mb']:.1f} | {r['working_mb']:.1f} | "
            f"{r['working_mb'] / base:.2f}x |"
        )
    for experts in EXPERTS:
        pair = [r for r in rows if r["experts"] == experts]
        if len(pair) == 2:
            same = abs(pair[0]["grad_checksum"] - pair[1]["grad_checksum"]) <= 1e-6 * pair[1]["grad_checksum"]
            print(f"{experts} experts: grouped and loop gradients agree: {same}")


if __name__ == "__main__":
    main()
