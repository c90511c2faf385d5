"""The printed table of an evaluation result (`genomelm eval`, the notebooks): one line per bucket, the
overall line, the late-vs-early contrast and the context cut, every change with its paired 95% interval.

A change is printed as "value ± half-width" and marked "*" where its interval excludes 0; an interval that
cannot be made (fewer than 2 windows with tokens) shows "n/a" and the reason is listed under the table.
"""

from __future__ import annotations

import math

from genomelm.eval.buckets import SUBSETS
from genomelm.eval.report import format_number, result_sets

MARK = "*"
CUT_SUBSETS = ("", "far_")  # the context cut's subsets the table shows (all positions, far copies)
LEGEND = (
    f"± : half-width of the 95% interval, paired across windows (Student t, windows - 1 d.f.); "
    f"{MARK} : it excludes 0"
)


def _missing(value: float | None) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def with_interval(
    interval: dict, scale: float = 100.0, digits: int = 2, unit: str = "%", column: bool = False
) -> str:
    """An `Estimate.as_dict()` as "value ± half-width<unit> *" (scaled: 100 for a relative change in %),
    "value<unit> n/a" without an interval, "-" without a value; `digits` decimals, more where the half-width
    needs them to show 2 significant digits; `column`: padded where there is no mark, so that a column of them
    aligns on the unit."""
    value = interval["value"]
    if _missing(value):
        return "-"
    if _missing(interval["low"]) or _missing(interval["high"]):
        return f"{scale * value:+.{digits}f}{unit} n/a"
    half = scale * (interval["high"] - interval["low"]) / 2
    if 0 < half < 10 ** (1 - digits):  # at least 2 significant digits of the half-width, up to 6 decimals
        digits = min(6, 1 - math.floor(math.log10(half)))
    text = f"{scale * value:+.{digits}f}"
    mark = f" {MARK}" if interval["excludes_zero"] else ("  " if column else "")
    return f"{text} ± {half:.{digits}f}{unit}{mark}"


def _change_cells(intervals: dict) -> str:
    """The change, repeat, unmasked and far-copy columns of a bucket's (or the overall) intervals."""
    names = ("change", "repeat_change", "unmasked_change", "far_change")
    return " ".join(f"{with_interval(intervals[name], column=True):>18}" for name in names)


def _reasons(result: dict) -> list[str]:
    """The distinct reasons of the result's intervals that are n/a, with where they occur."""
    places = [(f"bucket {i} ", bucket["intervals"]) for i, bucket in enumerate(result["buckets"])]
    places.append(("all ", result["overall"]["intervals"]))
    if result.get("context_cut"):
        hidden = tuple(prefix for prefix in SUBSETS if prefix not in CUT_SUBSETS)
        shown = {k: v for k, v in result["context_cut"]["intervals"].items() if not k.startswith(hidden)}
        places.append(("context cut ", shown))
    contrast = result.get("contrast") or {}
    places.append(
        (
            "",
            {name: contrast[name] for name in ("late_minus_early", "slope_per_doubling") if name in contrast},
        )
    )
    found: dict[str, list[str]] = {}
    for place, intervals in places:
        for name, interval in intervals.items():
            if interval["note"]:
                found.setdefault(interval["note"], []).append(place + name)
    return [
        f"{note}: {', '.join(where[:4])}{' ...' if len(where) > 4 else ''}" for note, where in found.items()
    ]


def _windows_line(result: dict) -> str:
    """How the scored windows were chosen (`genomelm.run.scoring.WindowRule`)."""
    provenance = result.get("provenance", {})
    rule, candidates = provenance.get("rule", "every held-out window"), provenance.get("candidates")
    chosen = result["settings"]["windows"]
    of = f" of {candidates}" if candidates is not None and candidates != chosen else ""
    total = provenance.get("heldout_windows")
    among = f" ({candidates} of {total} qualify)" if total is not None and candidates != total else ""
    return f"windows: {chosen}{of}, spread evenly over {rule}{among}"


def format_table(result: dict) -> str:
    """Fixed-width text table: one line per bucket, the overall line, the contrast and the context-cut
    numbers; for several held-out folders, their buckets side by side (`format_side_by_side`)."""
    if "sets" in result:
        return format_side_by_side(result)
    header = (
        f"{'bucket':>6} {'context (kb)':>13} {'tokens':>10} {'windows':>7} {'before':>7} {'s.e.':>6} "
        f"{'after':>7} {'s.e.':>6} {'change':>18} {'repeat':>18} {'unmasked':>18} {'far copy':>18}"
    )
    lines = [header, "-" * len(header)]
    for i, b in enumerate(result["buckets"]):
        span = f"{b['start'] / 1000:.1f}-{b['end'] / 1000:.1f}"
        before, after, ci = b["before"], b["after"], b["intervals"]
        lines.append(
            f"{i:>6} {span:>13} {after['tokens']:>10} {after['windows']:>7} "
            f"{format_number(before['loss'], '.4f'):>7} {format_number(before['se'], '.4f'):>6} "
            f"{format_number(after['loss'], '.4f'):>7} {format_number(after['se'], '.4f'):>6} "
            f"{_change_cells(ci)}"
        )
    o, ci = result["overall"], result["overall"]["intervals"]
    lines.append("-" * len(header))
    lines.append(
        f"{'all':>6} {'':>13} {o['tokens']:>10} {o['windows']:>7} "
        f"{format_number(o['loss_before'], '.4f'):>7} {format_number(o['loss_before_se'], '.4f'):>6} "
        f"{format_number(o['loss_after'], '.4f'):>7} {format_number(o['loss_after_se'], '.4f'):>6} "
        f"{_change_cells(ci)}"
    )
    lines += ["", _windows_line(result), LEGEND]
    lines += [f"n/a: {reason}" for reason in _reasons(result)]
    overall_nats = with_interval(ci["change_nats"], scale=1.0, digits=4, unit=" nats/base")
    lines.append(f"change over all tokens in nats: {overall_nats}")
    contrast = result.get("contrast")
    if contrast:
        late, slope = contrast["late_minus_early"], contrast["slope_per_doubling"]
        lines.append(
            f"late vs early: bucket {contrast['last_bucket']}'s change minus bucket "
            f"{contrast['first_bucket']}'s {with_interval(late, unit=' points')} ({late['windows']} windows)"
        )
        lines.append(
            f"change per doubling of context (slope over {contrast['slope_buckets']} buckets): "
            f"{with_interval(slope, unit=' points')}"
        )
    cut = result.get("context_cut")
    if cut:
        lines += ["", *context_cut_lines(cut)]
    return "\n".join(line.rstrip() for line in lines)


def context_cut_lines(cut: dict) -> list[str]:
    """The context cut, over all valid positions of the last bucket and over its far copies: per model the
    loss with full and with cut context, the cut's relative change and the long-context gain (cut - full,
    nats per base), and the changes after vs before."""
    ci = cut["intervals"]
    lines = [
        f"context cut: positions {cut['start']}-{cut['end']} scored with only the preceding "
        f"{cut['context']} tokens as context"
    ]
    for prefix, subset in zip(CUT_SUBSETS, ("all positions", "far copies")):
        windows = ci[f"{prefix}change_full"]["windows"]
        if not windows:
            lines.append(f" {subset}: none in the last bucket")
            continue
        lines.append(f" {subset} ({windows} windows with any):")
        for model in ("before", "after"):
            losses = cut[model]
            full = format_number(losses[f"{prefix}full"], ".4f")
            cut_loss = format_number(losses[f"{prefix}cut"], ".4f")
            gain = with_interval(ci[f"{prefix}{model}_gain_nats"], scale=1.0, digits=4, unit=" nats")
            change = with_interval(ci[f"{prefix}{model}_cut_change"])
            lines.append(
                f"  {model:<6} full context {full}  cut {cut_loss}  ({change}); long-context gain {gain}"
            )
        lines.append(
            f"  change after vs before: full context {with_interval(ci[f'{prefix}change_full'])}, "
            f"cut context {with_interval(ci[f'{prefix}change_cut'])}; "
            f"gain {with_interval(ci[f'{prefix}gain_change_nats'], scale=1.0, digits=4, unit=' nats')}"
        )
    return lines


def _side_cell(before: float | None, after: float | None, change: str) -> str:
    return f" | {format_number(before, '.4f'):>7} {format_number(after, '.4f'):>7} {change:>18}"


def format_side_by_side(result: dict) -> str:
    """Several held-out folders: one line per bucket with each folder's loss before and after and the change
    with its interval, the overall line, and each folder's contrast and context-cut change."""
    sets = result_sets(result)
    head = f"{'bucket':>6} {'context (kb)':>13}"
    width = len(_side_cell(0.0, 0.0, "")) - 3  # the three columns of one folder
    lines = [head + "".join(f" | {name[-width:]:^{width}}" for name, _ in sets)]
    lines.append(" " * len(head) + f" | {'before':>7} {'after':>7} {'change':>18}" * len(sets))
    lines.append("-" * len(lines[0]))
    for i, bucket in enumerate(sets[0][1]["buckets"]):
        span = f"{bucket['start'] / 1000:.1f}-{bucket['end'] / 1000:.1f}"
        rows = [one["buckets"][i] for _, one in sets]
        cells = [
            _side_cell(
                row["before"]["loss"],
                row["after"]["loss"],
                with_interval(row["intervals"]["change"], column=True),
            )
            for row in rows
        ]
        lines.append(f"{i:>6} {span:>13}" + "".join(cells))
    lines.append("-" * len(lines[0]))
    overall = [one["overall"] for _, one in sets]
    cells = [
        _side_cell(o["loss_before"], o["loss_after"], with_interval(o["intervals"]["change"], column=True))
        for o in overall
    ]
    lines.append(f"{'all':>6} {'':>13}" + "".join(cells))
    lines += ["", LEGEND]
    for name, one in sets:
        lines.append(
            f"{name}: {one['settings']['windows']} windows, {one['overall']['tokens']:,} tokens, "
            f"from {one['provenance']['data_dir']}"
        )
        lines += [f"  n/a: {reason}" for reason in _reasons(one)]
        late = one["contrast"]["late_minus_early"]
        lines.append(
            f"  late vs early (last bucket's change minus the first's): {with_interval(late, unit=' points')}"
        )
        cut = one.get("context_cut")
        if cut:
            ci = cut["intervals"]
            lines.append(
                f"  context cut (positions {cut['start']}-{cut['end']} with {cut['context']} tokens "
                f"of context): change after vs before {with_interval(ci['change_full'])} with full context, "
                f"{with_interval(ci['change_cut'])} cut"
            )
    return "\n".join(line.rstrip() for line in lines)
