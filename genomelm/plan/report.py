"""What the planner prints and writes: one plan as a table, the ranked layouts, the line a run that does not
fit is refused with, and runs/<run>/plan.json (the evaluation's, stage=eval: runs/<run>/plan-eval.json)."""

from __future__ import annotations

import json
from pathlib import Path

from genomelm.plan.layouts import Plan
from genomelm.run.config import TrainConfig


def layout_args(plan: Plan) -> str:
    """The key=value settings of a plan's layout (an evaluation's: dp, cp, ep)."""
    if plan.stage == "eval":
        return f"dp={plan.dp} cp={plan.cp} ep={plan.ep}"
    return (
        f"dp={plan.dp} cp={plan.cp} ep={plan.ep} offload={str(plan.offload).lower()} "
        f"optimizer_offload={str(plan.optimizer_offload).lower()} optimizer={plan.optimizer}"
    )


def refusal(config: TrainConfig, plan: Plan, candidates: list[Plan]) -> str:
    """Why the run does not fit, and the best layout of the same GPUs that does (`candidates`, ranked)."""
    gpus = f"{plan.gpus} x {config.plan.gpu.upper()}"
    best = next((p for p in candidates if p.fits), None)
    evaluating = plan.stage == "eval"
    if best and evaluating:
        fix = (
            f"best evaluation layout that fits {gpus}: {layout_args(best)} ({best.peak_gib_per_rank:.1f} "
            f"GiB per rank, {best.step_s:,.1f} s per window projected)"
        )
    elif best:
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
    what, anyway = ("the evaluation of run", "evaluates") if evaluating else ("run", "trains")
    return (
        f"{what} {config.run} does not fit: {plan.peak_gib_per_rank:.1f} GiB per rank > "
        f"{plan.usable_gib:.0f} GiB usable on {config.plan.gpu.upper()} ({layout_args(plan)}); {fix}; "
        f"force=true {anyway} anyway"
    )


def describe(plan: Plan) -> str:
    """The plan as a table."""
    if plan.evaluation is not None:
        return describe_eval(plan)
    a = plan.assumptions
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines = [
        (
            f"plan {plan.run}: {plan.seq:,}-token windows on {plan.gpus} x {plan.gpu.upper()} "
            f"(dp {plan.dp} x cp {plan.cp}, ep {plan.ep}; fsdp {plan.fsdp}; recompute {plan.recompute}, "
            f"offload {plan.offload}, optimizer_offload {plan.optimizer_offload}; optimizer {plan.optimizer})"
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
    r = plan.roofline
    lines.append(
        f"  projected: {plan.step_s:,.1f} s per step, {plan.tokens_per_s_projected:,.0f} tokens/s, "
        f"MFU {r['mfu']:.1%}, HFU {r['hfu']:.1%} (per window: compute {a['compute_s']:.2f} s + communication "
        f"{a['comm_s']:.2f} s + side-stream work not hidden {a['exposed_overlap_s']:.2f} s of "
        f"{a['overlapped_s']:.2f} s + host {a['host_copy_s']:.2f} s)"
    )
    if plan.range:
        low, high = plan.range["low"], plan.range["high"]
        lines.append(
            f"  range (every rate at its low / high end, rates.py; expert load at its quantiles): "
            f"{low['tokens_per_s']:,.0f} / {plan.tokens_per_s_projected:,.0f} / {high['tokens_per_s']:,.0f} "
            f"tokens/s (low / expected / high); peak {high['peak_gib']:.1f} / {plan.peak_gib_per_rank:.1f} / "
            f"{low['peak_gib']:.1f} GiB (least / expected / most)"
        )
    if r.get("exposed_parts"):
        lines.append(
            "  not hidden, per window: " + ", ".join(f"{k} {v:.2f} s" for k, v in r["exposed_parts"].items())
        )
    if r.get("host_parts"):
        lines.append(
            "  host work per window: " + ", ".join(f"{k} {v:.2f} s" for k, v in r["host_parts"].items())
        )
    lines.append(
        f"  MFU: {r['model_flops_per_token']:.3e} model FLOPs per token (HFU: "
        f"{r['executed_flops_per_token']:.3e} executed, recompute included) x tokens/s / ({plan.gpus} GPUs x "
        f"{r['peak_bf16'] / 1e12:,.0f} TFLOP/s dense bf16 datasheet peak); model FLOPs: the mean rank's "
        "traced forward + backward without recompute"
    )
    lines += roofline_lines(plan)
    lines.append(_assumed(a))
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


BY_SOURCE = 8  # source files named in the report's roofline summary


def roofline_lines(plan: Plan) -> list[str]:
    """The op classes that cost most (at the mean rank and, with expert parallelism, the busiest one) and
    the flat estimate beside the roofline's."""
    r, a = plan.roofline, plan.assumptions
    lines = [
        f"  flat estimate (FLOPs at mfu={a['mfu']} of the bf16 peak, communication as above): "
        f"{r['flat_tokens_per_s']:,.0f} tokens/s"
    ]
    tables = [("op classes that cost most, one rank (share of the window's time)", r["top"])]
    if plan.ep > 1:
        tables.append(("the same at the busiest expert-parallel rank", r["busiest_top"]))
    for title, rows in tables:
        lines.append(f"  {title}:")
        lines.append(f"    {'share':>6} {'seconds':>9} {'bound':<8} {'at':>14} {'TFLOP':>9} {'GB':>9}  class")
        lines += [
            f"    {row['share']:>6.1%} {row['seconds']:>9.3f} {row['bound']:<8} {_rate(row):>14} "
            f"{row['tflop']:>9.2f} {row['gb']:>9.1f}  {row['class']}"
            for row in rows
        ]
    keys = {row["rate"] for _, rows in tables for row in rows}
    lines.append("  the rates these classes ran at (genomelm/plan/rates.py):")
    lines += [f"    {key}: {source}" for key, source in _sources(r, keys)]
    if r.get("by_source"):
        shares = ", ".join(
            f"{row['source'].removeprefix('genomelm/')} {row['share']:.1%}"
            for row in r["by_source"][:BY_SOURCE]
        )
        lines.append(f"  by source file, {'busiest rank' if plan.ep > 1 else 'one rank'}: {shares}")
    return lines


def _rate(row: dict) -> str:
    """A top class's rate, in its unit: TFLOP/s, TB/s or us per launch."""
    if row["rate"] == "launch":
        return f"{row['rate_value'] * 1e6:.1f} us/op"
    if row["rate"] == "memory":
        return f"{row['rate_value'] / 1e12:.2f} TB/s"
    return f"{row['rate_value'] / 1e12:,.1f} TFLOP/s"


def _sources(roofline: dict, keys: set[str]) -> list[tuple[str, str]]:
    """(rate key, its source) for `keys`, in the rates table's order; a rate the table lacks (a CPU's,
    measured) as measured."""
    table = {row["key"]: row["source"] for row in roofline.get("rates", [])}
    ordered = [k for k in table if k in keys] + sorted(keys - set(table))
    return [(k, table.get(k, "measured on this machine")) for k in ordered]


def _assumed(a: dict) -> str:
    return (
        f"  assumptions: mfu={a['mfu']} tflops={a['tflops']} nvlink_gbs={a['nvlink_gbs']} "
        f"nic_gbs={a['nic_gbs']} nics_per_node={a['nics_per_node']} pcie_gbs={a['pcie_gbs']} "
        f"gpus_per_node={a['gpus_per_node']} "
        f"host_gib={a['host_gib']:.0f} imbalance={a['imbalance']:.2f} ({a['imbalance_source']}) "
        f"trace_tokens={a['trace_tokens']}"
    )


def _s(seconds: float) -> str:
    """Seconds with two decimals, or three significant digits below 0.1 s (small models)."""
    return f"{seconds:,.2f} s" if seconds >= 0.1 or seconds == 0 else f"{seconds:.3g} s"


def describe_eval(plan: Plan) -> str:
    """An evaluation's plan as a table: its peak per rank, one window's forward, the context cut's and the
    whole before/after evaluation."""
    a, e = plan.assumptions, plan.evaluation
    assert e is not None
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines = [
        (
            f"plan {plan.run}, evaluation: {plan.seq:,}-token windows on {plan.gpus} x {plan.gpu.upper()} "
            f"(dp {plan.dp} x cp {plan.cp}, ep {plan.ep}; fsdp {plan.fsdp}; precision {a['precision']}; "
            "forward only, no_grad)"
        ),
        f"  {verdict}: peak {plan.peak_gib_per_rank:,.1f} GiB per rank of {plan.usable_gib:.0f} GiB usable",
        "  device memory per rank (GiB):",
    ]
    lines += [f"    {k:<64} {v:>10,.2f}" for k, v in plan.device_gib.items()]
    lines.append("  transients by module (GiB):")
    lines += [f"    {k:<64} {v:>10,.2f}" for k, v in plan.transients_gib.items()]
    lines.append(
        f"  FLOPs per token (forward, per rank): {plan.flops_per_token:.3e} (busiest expert-parallel rank: "
        f"{a['busiest_rank_flops_per_token']:.3e})"
    )
    lines.append("  bytes communicated per window per rank (the full window's forward):")
    lines += [f"    {k:<64} {v / 1e9:>10,.2f} GB" for k, v in plan.comm_bytes_per_step.items()]
    lines.append(
        f"  projected per window: {_s(e.window_s)} (compute {_s(a['compute_s'])} + communication "
        f"{_s(a['comm_s'])} + side-stream work not hidden {_s(a['exposed_overlap_s'])})"
        + (f"; context cut ({e.cut_tokens:,} tokens): {_s(e.cut_s)}" if e.cut_tokens else "; no context cut")
    )
    lines += roofline_lines(plan)
    lines.append(
        f"  held-out windows: {e.windows if e.windows is not None else 'unknown'} ({e.windows_source})"
    )
    if e.total_s is not None:
        forwards = f"{_s(e.window_s)} + {_s(e.cut_s)}" if e.cut_tokens else _s(e.window_s)
        lines.append(
            f"  whole evaluation: {e.models} models x {e.per_replica} windows per dp replica (ceil "
            f"{e.windows} / dp {plan.dp}) x ({forwards}) = {_s(e.total_s)} = {e.total_s / 3600:,.2f} h "
            "(before + after training)"
        )
    lines.append(_assumed(a))
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


def describe_search(plans: list[Plan], limit: int = 0) -> str:
    """The ranked layouts as a table, the first `limit` of them (0: all)."""
    if plans and plans[0].evaluation is not None:
        return _describe_eval_search(plans, limit)
    rows = [
        (
            f"{'fits':<5} {'dp':>3} {'cp':>3} {'ep':>3} {'offload':<8} {'opt_offload':<12} {'optimizer':<11} "
            f"{'peak GiB':>10} {'host GiB/node':>14} {'tokens/s':>10}"
        )
    ]
    for p in plans[: limit or None]:
        switches = f"{str(p.offload).lower():<8} {str(p.optimizer_offload).lower():<12} {p.optimizer:<11}"
        sizes = f"{p.peak_gib_per_rank:>10,.1f} {p.host_gib_total:>14,.1f} {p.tokens_per_s_projected:>10,.0f}"
        rows.append(f"{'yes' if p.fits else 'no':<5} {p.dp:>3} {p.cp:>3} {p.ep:>3} {switches} {sizes}")
    if limit and len(plans) > limit:
        rows.append(f"... {len(plans) - limit} more in plan.json")
    return "\n".join(rows)


def _describe_eval_search(plans: list[Plan], limit: int) -> str:
    """Ranked evaluation layouts: peak, seconds per window and context cut, hours for before + after."""
    rows = [
        f"{'fits':<5} {'dp':>3} {'cp':>3} {'ep':>3} {'peak GiB':>10} {'s/window':>9} {'s/cut':>7} "
        f"{'hours':>7}"
    ]
    for p in plans[: limit or None]:
        e = p.evaluation
        assert e is not None
        hours = f"{e.total_s / 3600:>7,.2f}" if e.total_s is not None else f"{'?':>7}"
        rows.append(
            f"{'yes' if p.fits else 'no':<5} {p.dp:>3} {p.cp:>3} {p.ep:>3} {p.peak_gib_per_rank:>10,.1f} "
            f"{e.window_s:>9,.2f} {e.cut_s:>7,.2f} {hours}"
        )
    if limit and len(plans) > limit:
        rows.append(f"... {len(plans) - limit} more in plan-eval.json")
    return "\n".join(rows)


def write_plan(config: TrainConfig, plans: list[Plan]) -> Path:
    """runs/<run>/plan.json (the evaluation's: plan-eval.json, beside the training's): plans[0], the run's own
    layout; the rest (search=true), ranked, under "search"."""
    path = config.run_dir / ("plan-eval.json" if config.plan.stage == "eval" else "plan.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    body = plans[0].to_json() | ({"search": [p.to_json() for p in plans[1:]]} if len(plans) > 1 else {})
    path.write_text(json.dumps(body, indent=2))
    return path
