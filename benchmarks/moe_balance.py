"""Experts placed by load: the busiest expert-parallel rank's tokens over the mean rank's, under the static
blocks, under the placements training runs (`expert_placement=balanced`: each expert owned by one rank,
`balanced_placement`; with `expert_copies=1`, a copy slot per rank, `placement_with_replicas`) and under the
joint packing of all copies that bounds them (`balanced_placement(..., spare=1)`), at ep 8, 16 and 32, for
skewed synthetic loads over GLM-5.3-Flash's 288 routed experts; then the planner's projected tokens/s of the
1M run (configs/train/hg38-1m.yaml's layout at that ep, 64 B200) at each of the three training figures
(with copies: their weights' exchange and memory counted).

    python benchmarks/moe_balance.py                 # Zipf loads fitted to 4x (published) and 2x at ep=32
    python benchmarks/moe_balance.py --no-plan       # the placement table alone (a second)
    python benchmarks/moe_balance.py --no-plan --load runs/<run>/expert_load.json   # and a run's own load

The load model: the k-th hottest expert gets tokens in proportion to 1 / k**s, the experts in a seeded random
order, s fitted so the static blocks give the target ratio at ep=32 (the published recipe measured the
busiest GPU at about 4x the mean).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from genomelm.parallel.placement import (
    balanced_placement,
    fit_zipf,
    placement_with_replicas,
    static_placement,
    zipf_load,
)
from genomelm.run.metrics import read_expert_load

ROOT = Path(__file__).resolve().parents[1]
EXPERTS = 288
EPS = (8, 16, 32)


def placement_rows(target: float, seed: int) -> list[dict[str, float]]:
    """busiest/mean at each ep: static, owned by load, with a copy slot per rank, all copies packed at
    once."""
    exponent = fit_zipf(EXPERTS, 32, target, seed)
    load = zipf_load(EXPERTS, exponent, seed)
    rows = []
    for ep in EPS:
        with_copies = placement_with_replicas(load, ep, 1)
        rows.append(
            {
                "target": target,
                "exponent": exponent,
                "ep": ep,
                "static": static_placement(EXPERTS, ep).busiest_over_mean(load),
                "placed": balanced_placement(load, ep).busiest_over_mean(load),
                "copies": with_copies.busiest_over_mean(load),
                "copy_weights": with_copies.copy_weights(EXPERTS, ep),
                "joint": balanced_placement(load, ep, spare=1).busiest_over_mean(load),
            }
        )
    return rows


def logged_rows(path: Path) -> list[dict[str, float]]:
    """A run's own load (`expert_load.json`): at each ep of 2..32 that divides its experts, the MoE layers'
    busiest/mean as the step adds them up (`genomelm.plan.layouts.logged_imbalance`, what `genomelm plan`
    takes), each layer placed on its own, static and placed."""
    from genomelm.plan.layouts import logged_imbalance

    layers, ratios = len(read_expert_load(path)), logged_imbalance(path)
    return [
        {
            "ep": ep,
            "layers": layers,
            "experts": ratios["logged_experts"],
            "static": static,
            "placed": ratios["logged_placed"][ep],
        }
        for ep, static in ratios["logged_static"].items()
        if ep <= 32
    ]


PLANNED = ("static", "placed", "copies")


def projected_tokens_per_s(rows: list[dict[str, float]]) -> None:
    """Adds the plan's tokens/s at each training figure as the imbalance (one trace pair, shared): a placed
    run's memory sized for the static blocks (it starts on them), with copies their weights' exchange."""
    from genomelm.plan.check import make_plan
    from genomelm.plan.layouts import load_assumptions
    from genomelm.plan.memory import TraceCache
    from genomelm.run.config import TrainConfig

    config = TrainConfig.load(ROOT / "configs" / "train" / "hg38-1m.yaml", ["device=cpu"])
    traces = TraceCache()
    for row in rows:
        for key in PLANNED:
            run = config.replace(ep=int(row["ep"]), imbalance=row[key])
            assumptions = load_assumptions(run)
            if key != "static":
                copy_weights = row["copy_weights"] if key == "copies" else 0.0
                placed = {"static_imbalance": row["static"], "copy_weights": copy_weights}
                assumptions = dataclasses.replace(assumptions, **placed)
            plan = make_plan(run, assumptions=assumptions, traces=traces)
            row[f"{key}_tokens_per_s"] = plan.tokens_per_s_projected
            row[f"{key}_fits"] = plan.fits


def format_table(rows: list[dict[str, float]], with_plan: bool) -> str:
    head = "| load (static at ep=32) | Zipf s | ep | static | placed | placed, 1 copy slot | joint bound |"
    rule = "|---|---|---|---|---|---|---|"
    if with_plan:
        head += " tokens/s static | tokens/s placed | tokens/s with copies |"
        rule += "---|---|---|"
    lines = [head, rule]
    for row in rows:
        line = (
            f"| {row['target']:.1f}x | {row['exponent']:.3f} | {row['ep']} | {row['static']:.2f} "
            f"| {row['placed']:.2f} | {row['copies']:.2f} | {row['joint']:.2f} |"
        )
        if with_plan:
            for key in PLANNED:
                fits = "" if row[f"{key}_fits"] else " (does not fit)"
                line += f" {row[f'{key}_tokens_per_s'] / 1000:.1f}k{fits} |"
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", type=float, nargs="*", default=[4.0, 2.0], help="static ratios at ep=32")
    parser.add_argument("--seed", type=int, default=0, help="the order of the experts")
    parser.add_argument("--no-plan", action="store_true", help="skip the planner (its traces take minutes)")
    parser.add_argument("--load", type=Path, help="a run's expert_load.json: its own load, placed")
    args = parser.parse_args()
    rows = [row for target in args.targets for row in placement_rows(target, args.seed)]
    if not args.no_plan:
        projected_tokens_per_s(rows)
    print(format_table(rows, not args.no_plan))
    if args.load is not None:
        print(f"\n{args.load}: the MoE layers' busiest/mean, static and placed (each layer on its own)\n")
        print("| ep | layers | experts | static | placed |\n|---|---|---|---|---|")
        for row in logged_rows(args.load):
            cells = [f"{row[k]}" for k in ("ep", "layers", "experts")] + [
                f"{row[k]:.2f}" for k in ("static", "placed")
            ]
            print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
