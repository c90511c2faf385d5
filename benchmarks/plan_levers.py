"""The speed levers one by one, at full size: the plan (`genomelm plan`, the per-layer event model) of a
shipped config's own layout with every lever off, each lever alone, and all of them together, on 64 GPUs:
tokens/s expected (low-high), peak GiB per GPU expected (least-most), and whether the expected peak fits a
budget.
docs/planner.md's lever table is this script's output.

    python benchmarks/plan_levers.py                       # hg38-1m on 64 B200 (about a minute on 2 cores)
    python benchmarks/plan_levers.py --config hg38-512k    # the 512k config
    python benchmarks/plan_levers.py --gpu h200            # FP8 rowwise in place of MXFP8

Levers (issue 47): `fsdp_prefetch` (FSDP2 gathers that many layers ahead; each costs a gathered layer),
`reduce_dtype=bf16` (gradients reduce-scattered in bf16), `expert_precision` (the routed experts' grouped
GEMMs through torchao: MXFP8 on B200, FP8 rowwise on H100 / H200). The layout, optimizer and memory settings
are the config's own; the traces are shared by every row (the levers change only the costing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from genomelm.plan.check import make_plan
from genomelm.plan.memory import TraceCache
from genomelm.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
OFF = {"fsdp_prefetch": 0, "reduce_dtype": "fp32", "expert_precision": "bf16"}


def levers(gpu: str) -> list[tuple[str, dict[str, object]]]:
    """(row name, the settings over `OFF`) for each row of the table."""
    low = "mxfp8" if gpu == "b200" else "fp8_rowwise"
    return [
        ("every lever off", {}),
        ("fsdp_prefetch=1", {"fsdp_prefetch": 1}),
        ("fsdp_prefetch=2", {"fsdp_prefetch": 2}),
        ("reduce_dtype=bf16", {"reduce_dtype": "bf16"}),
        (f"expert_precision={low}", {"expert_precision": low}),
        ("fsdp_prefetch=1 + reduce_dtype=bf16", {"fsdp_prefetch": 1, "reduce_dtype": "bf16"}),
        (
            f"all: fsdp_prefetch=1 + reduce_dtype=bf16 + expert_precision={low}",
            {"fsdp_prefetch": 1, "reduce_dtype": "bf16", "expert_precision": low},
        ),
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="hg38-1m", help="configs/train/<name>.yaml")
    parser.add_argument("--gpu", default="b200", choices=("b200", "h200", "h100"))
    parser.add_argument("--budget", type=float, default=128.0, help="GiB per GPU the expected peak must fit")
    args = parser.parse_args(argv)
    path = ROOT / "configs" / "train" / f"{args.config}.yaml"
    base = TrainConfig.load(path, ["gpus=64", f"gpu={args.gpu}", "device=cpu"])
    traces = TraceCache()
    print(f"{args.config} ({base.seq_len:,} tokens) on 64 {args.gpu.upper()}, its own layout:")
    print(
        "| levers | tokens/s expected (low-high) | vs off | peak GiB expected (least-most) | "
        f"fits {args.budget:g} GiB (expected) |"
    )
    print("|---|---|---|---|---|")
    off = None
    for name, settings in levers(args.gpu):
        plan = make_plan(base.replace(**(OFF | settings)), traces=traces)
        low, high = plan.range["low"], plan.range["high"]
        speed = plan.tokens_per_s_projected
        off = off or speed
        print(
            f"| {name} | {speed / 1e3:,.1f}k ({low['tokens_per_s'] / 1e3:,.1f}-"
            f"{high['tokens_per_s'] / 1e3:,.1f}k) | {speed / off - 1:+.1%} | "
            f"{plan.peak_gib_per_rank:.1f} ({high['peak_gib']:.1f}-{low['peak_gib']:.1f}) | "
            f"{'yes' if plan.peak_gib_per_rank <= args.budget else 'no'} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
