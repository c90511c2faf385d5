"""The planner at full size: GLM-5.3-Flash on 64 GPUs, the layout `genomelm plan search=true` ranks first for
each window and GPU, with its projected tokens/s, MFU and HFU (`genomelm.plan.timing.MFU_FORMULA`), peak
memory per GPU and where a window's time goes. docs/planner.md's full-size table is this script's output,
and `--check` says whether the shipped run configs carry the first choice of their own case.

    python benchmarks/plan_table.py            # the table (about 2 minutes on 2 cores: two sets of traces)
    python benchmarks/plan_table.py --check    # and exit 1 when a shipped config is not its case's first

Cases: 256k, 512k (configs/train/hg38-512k.yaml) and 1M (hg38-1m.yaml) on 64 B200 within the published
recipe's 144.5 GiB per GPU and on 64 H200 within their usable 139 GiB; 1M on B200 within the goal's 128 GiB.
The traces are shared between the cases of one config (the GPU and the budget change only the costing).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from genomelm.plan.layouts import Plan
from genomelm.plan.memory import TraceCache
from genomelm.plan.search import search
from genomelm.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = {262144: "24.9k", 1048576: "13.7k"}  # the reference recipe's measured tokens/s on 64 B200


@dataclass(frozen=True)
class Case:
    config: str  # configs/train/<name>.yaml
    seq: str
    gpu: str
    gpu_gib: float  # 0: the GPU's usable memory
    shipped: bool = False  # the config's own case: its layout must be this case's first choice

    def settings(self) -> list[str]:
        return [f"seq={self.seq}", "gpus=64", f"gpu={self.gpu}", f"gpu_gib={self.gpu_gib}", "device=cpu"]


CASES = (
    Case("hg38-512k", "256k", "b200", 144.5),
    Case("hg38-512k", "512k", "b200", 144.5, shipped=True),
    Case("hg38-512k", "256k", "h200", 0.0),
    Case("hg38-512k", "512k", "h200", 0.0),
    Case("hg38-1m", "1M", "b200", 144.5, shipped=True),
    Case("hg38-1m", "1M", "b200", 128.0),
    Case("hg38-1m", "1M", "h200", 0.0),
)
LAYOUT = ("dp", "cp", "ep", "offload", "optimizer_offload", "optimizer")


def config_of(case: Case) -> TrainConfig:
    return TrainConfig.load(ROOT / "configs" / "train" / f"{case.config}.yaml", case.settings())


def first_choice(case: Case, traces: TraceCache) -> Plan:
    """The layout `search` ranks first for `case` (it fits: the search ranks fitting layouts first)."""
    best = search(config_of(case), traces=traces)[0]
    if not best.fits:
        raise SystemExit(
            f"no layout of 64 x {case.gpu} fits {case.seq} within {case.gpu_gib or 'usable'} GiB"
        )
    return best


def layout_of(plan: Plan) -> dict[str, object]:
    return {key: getattr(plan, key) for key in LAYOUT}


def shipped_layout(case: Case) -> dict[str, object]:
    config = TrainConfig.load(ROOT / "configs" / "train" / f"{case.config}.yaml")
    p, m = config.parallel, config.memory
    return {
        "dp": p.dp,
        "cp": p.cp,
        "ep": p.ep,
        "offload": m.offload,
        "optimizer_offload": p.optimizer_offload,
        "optimizer": config.optim.optimizer,
    }


def row(case: Case, plan: Plan) -> str:
    r = plan.roofline
    layout = f"dp {plan.dp} x cp {plan.cp}, ep {plan.ep}" + (", offload" if plan.offload else "")
    layout += ", optimizer offload" if plan.optimizer_offload else ""
    layout += f", {plan.optimizer}"
    budget = f"{case.gpu_gib:g}" if case.gpu_gib else "usable"
    parts = f"{r['compute_s']:.1f} / {r['comm_s']:.1f} / {r['exposed_overlap_s'] + r['host_s']:.1f}"
    top = r["busiest_top"][0] if plan.ep > 1 else r["top"][0]
    published = PUBLISHED.get(plan.seq, "-") if case.gpu == "b200" else "-"
    low, high = plan.range["low"], plan.range["high"]
    speed = (
        f"{plan.tokens_per_s_projected / 1e3:,.1f}k ({low['tokens_per_s'] / 1e3:,.1f}-"
        f"{high['tokens_per_s'] / 1e3:,.1f}k)"
    )
    peak = f"{plan.peak_gib_per_rank:.1f} ({high['peak_gib']:.1f}-{low['peak_gib']:.1f})"
    return (
        f"| {case.seq} | {case.gpu.upper()} ({budget} GiB) | {layout} | {speed} | "
        f"{r['mfu']:.1%} | {r['hfu']:.1%} | {published} | {peak} | {parts} | "
        f"`{top['class']}` ({top['share']:.0%}, {top['bound']}) |"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a shipped config is not first")
    args = parser.parse_args(argv)
    print(
        "| window | GPU (budget per GPU) | first layout (`search=true`) | tokens/s expected (low-high) | "
        "MFU | HFU | published | peak GiB expected (least-most) | "
        "window s: compute / comm / host + exposed | costliest class at the busiest rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    traces: dict[str, TraceCache] = {}
    drift = []
    for case in CASES:
        best = first_choice(case, traces.setdefault(case.config, TraceCache()))
        print(row(case, best), flush=True)
        if case.shipped and layout_of(best) != shipped_layout(case):
            drift.append(
                f"configs/train/{case.config}.yaml: {shipped_layout(case)}, first: {layout_of(best)}"
            )
    for line in drift:
        print(f"drift: {line}")
    return 1 if args.check and drift else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
