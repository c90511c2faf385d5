"""What the planner prints and writes: one plan as a table, the ranked layouts, the line a run that does not
fit is refused with, and runs/<run>/plan.json."""

from __future__ import annotations

import json
from pathlib import Path

from genomelm.train.config import TrainConfig
from genomelm.train.plan_types import Plan


def layout_args(plan: Plan) -> str:
    """The key=value settings of a plan's layout."""
    return (
        f"dp={plan.dp} cp={plan.cp} ep={plan.ep} offload={str(plan.offload).lower()} "
        f"optimizer_offload={str(plan.optimizer_offload).lower()}"
    )


def refusal(config: TrainConfig, plan: Plan, candidates: list[Plan]) -> str:
    """Why the run does not fit, and the best layout of the same GPUs that does (`candidates`, ranked)."""
    gpus = f"{plan.gpus} x {config.plan.gpu.upper()}"
    best = next((p for p in candidates if p.fits), None)
    if best:
        fix = (
            f"best layout that fits {gpus}: {layout_args(best)} ({best.peak_gib_per_rank:.1f} GiB per "
            f"rank, {best.host_gib_total:,.0f} GiB host per node, {best.tokens_per_s_projected:,.0f} "
            "tokens/s projected)"
        )
    elif candidates:
        fix = (
            f"no layout of {gpus} fits (best: {candidates[0].peak_gib_per_rank:.1f} GiB per rank with "
            f"{layout_args(candidates[0])})"
        )
    else:
        fix = f"no layout of {plan.gpus} GPUs fits"
    return (
        f"run {config.run} does not fit: {plan.peak_gib_per_rank:.1f} GiB per rank > "
        f"{plan.usable_gib:.0f} GiB usable on {config.plan.gpu.upper()} ({layout_args(plan)}); {fix}; "
        "force=true trains anyway"
    )


def describe(plan: Plan) -> str:
    """The plan as a table."""
    a = plan.assumptions
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines = [
        (
            f"plan {plan.run}: {plan.seq:,}-token windows on {plan.gpus} x {plan.gpu.upper()} "
            f"(dp {plan.dp} x cp {plan.cp}, ep {plan.ep}; fsdp {plan.fsdp}; recompute {plan.recompute}, "
            f"offload {plan.offload}, optimizer_offload {plan.optimizer_offload})"
        ),
        (
            f"  {verdict}: peak {plan.peak_gib_per_rank:,.1f} GiB per rank of {plan.usable_gib:.0f} GiB "
            f"usable; host {plan.host_gib_total:,.0f} GiB per node of {a['host_gib']:,.0f} GiB"
        ),
        "  device memory per rank (GiB):",
    ]
    lines += [f"    {k:<58} {v:>10,.2f}" for k, v in plan.device_gib.items()]
    lines.append("  transients by module (GiB):")
    lines += [f"    {k:<58} {v:>10,.2f}" for k, v in plan.transients_gib.items()]
    lines.append(f"  host memory per node (GiB): {plan.host_gib_total:,.1f}")
    lines += [f"    {k:<58} {v:>10,.1f}" for k, v in plan.host_gib_per_node.items()]
    lines.append(
        f"  FLOPs per token (per rank, recompute included): {plan.flops_per_token:.3e}"
        f" (busiest expert-parallel rank: {a['busiest_rank_flops_per_token']:.3e})"
    )
    lines.append("  bytes communicated per step per rank:")
    lines += [f"    {k:<58} {v / 1e9:>10,.2f} GB" for k, v in plan.comm_bytes_per_step.items()]
    lines.append(
        f"  projected: {plan.step_s:,.1f} s per step, {plan.tokens_per_s_projected:,.0f} tokens/s "
        f"(compute {a['compute_s']:.2f} s + communication {a['comm_s']:.2f} s + offload copies "
        f"{a['host_copy_s']:.2f} s per window, no overlap)"
    )
    lines.append(
        f"  assumptions: mfu={a['mfu']} tflops={a['tflops']} nvlink_gbs={a['nvlink_gbs']} "
        f"ib_gbs={a['ib_gbs']} pcie_gbs={a['pcie_gbs']} gpus_per_node={a['gpus_per_node']} "
        f"host_gib={a['host_gib']:.0f} imbalance={a['imbalance']:.2f} ({a['imbalance_source']}) "
        f"trace_tokens={a['trace_tokens']}"
    )
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


def describe_search(plans: list[Plan], limit: int = 0) -> str:
    """The ranked layouts as a table, the first `limit` of them (0: all)."""
    rows = [
        (
            f"{'fits':<5} {'dp':>3} {'cp':>3} {'ep':>3} {'offload':<8} {'opt_offload':<12} {'peak GiB':>10} "
            f"{'host GiB/node':>14} {'tokens/s':>10}"
        )
    ]
    for p in plans[: limit or None]:
        switches = f"{str(p.offload).lower():<8} {str(p.optimizer_offload).lower():<12}"
        sizes = f"{p.peak_gib_per_rank:>10,.1f} {p.host_gib_total:>14,.1f} {p.tokens_per_s_projected:>10,.0f}"
        rows.append(f"{'yes' if p.fits else 'no':<5} {p.dp:>3} {p.cp:>3} {p.ep:>3} {switches} {sizes}")
    if limit and len(plans) > limit:
        rows.append(f"... {len(plans) - limit} more in plan.json")
    return "\n".join(rows)


def write_plan(config: TrainConfig, plans: list[Plan]) -> Path:
    """runs/<run>/plan.json: plans[0], the run's own layout; the rest (search=true), ranked, under
    "search"."""
    path = config.run_dir / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = plans[0].to_json() | ({"search": [p.to_json() for p in plans[1:]]} if len(plans) > 1 else {})
    path.write_text(json.dumps(body, indent=2))
    return path
