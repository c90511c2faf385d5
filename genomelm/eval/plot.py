"""Figures: loss per position bucket before/after training and its relative change; the copy probe's gap."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # matplotlib (about 0.3 s to import) only where a figure is drawn
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

from genomelm.data.regions import seq_label
from genomelm.eval.report import result_sets


def context_kb(buckets: list[dict]) -> np.ndarray:
    """Bucket midpoints in kb (1000 tokens) of context: [n_buckets]."""
    return np.array([(b["start"] + b["end"]) / 2 / 1000 for b in buckets])


def interval_bars(intervals: list[dict], scale: float = 100.0) -> tuple[np.ndarray, np.ndarray]:
    """Values [K] and asymmetric error bars [2, K] of `Estimate.as_dict()`s, scaled (100: in %); a bar is 0
    where the interval is n/a."""
    value = np.array([np.nan if i["value"] is None else i["value"] for i in intervals], dtype=float)
    low = np.array([np.nan if i["low"] is None else i["low"] for i in intervals], dtype=float)
    high = np.array([np.nan if i["high"] is None else i["high"] for i in intervals], dtype=float)
    bars = np.nan_to_num(np.stack([value - low, high - value]))
    return scale * value, scale * bars


def draw(result: dict, axes: tuple[Axes, Axes]) -> None:
    """Draw a `buckets.json` result on two axes: loss +- s.e. before/after, and the change in % with its
    paired 95% interval per bucket and overall."""
    buckets = result["buckets"]
    x = context_kb(buckets)
    widths = np.array([0.8 * (b["end"] - b["start"]) / 1000 for b in buckets])
    loss_ax, change_ax = axes
    for key, colour in (("before", "tab:gray"), ("after", "tab:blue")):
        loss = np.array([np.nan if b[key]["loss"] is None else b[key]["loss"] for b in buckets], dtype=float)
        se = np.array([np.nan if b[key]["se"] is None else b[key]["se"] for b in buckets], dtype=float)
        loss_ax.errorbar(
            x, loss, yerr=np.nan_to_num(se), marker="o", ms=3, capsize=3, color=colour, label=key
        )
    loss_ax.set_xlabel("context (kb, bucket midpoint)")
    loss_ax.set_ylabel("held-out loss (nats/base)")
    loss_ax.set_title("loss by position (bars: 95% intervals across windows)")
    loss_ax.legend()
    change, bars = interval_bars([b["intervals"]["change"] for b in buckets])
    colours = ["tab:green" if c < 0 else "tab:red" for c in np.nan_to_num(change)]
    change_ax.bar(x, np.nan_to_num(change), width=widths, color=colours, yerr=bars, capsize=3, ecolor="black")
    overall = result["overall"]["intervals"]["change"]
    if overall["value"] is not None:
        value, (below, above) = interval_bars([overall])
        label = f"overall {value[0]:+.2f}%"
        change_ax.axhline(value[0], color="black", ls="--", lw=1, label=label)
        if overall["low"] is not None:
            band = (value[0] - below[0], value[0] + above[0])
            change_ax.axhspan(
                *band,
                color="black",
                alpha=0.12,
                lw=0,
                label=f"95% interval {band[0]:+.2f} to {band[1]:+.2f}%",
            )
        change_ax.legend()
    change_ax.axhline(0, color="black", lw=0.5)
    change_ax.set_xlabel("context (kb, bucket midpoint)")
    change_ax.set_ylabel("relative change after vs before (%)")
    change_ax.set_title("(after - before) / before, paired 95% intervals")


def draw_sets(result: dict, figure: Figure) -> None:
    """A column of two panels (loss, change) per held-out folder of a result (one or several folders), the
    loss axes shared."""
    sets = result_sets(result)
    axes = figure.subplots(2, len(sets), sharey="row", squeeze=False)
    for column, (name, one) in enumerate(sets):
        draw(one, (axes[0][column], axes[1][column]))
        axes[0][column].set_title(f"{name}: loss by position ({one['settings']['windows']} windows)")
        axes[1][column].set_title(f"{name}: (after - before) / before")


def save_figure(result: dict, path: Path) -> Path:
    """Write the figure of `result` as PNG to `path` (through a temporary name): two panels, or for several
    held-out folders a column of two panels each."""
    from matplotlib.figure import Figure

    settings = result["settings"]
    if "sets" in result:
        figure = Figure(figsize=(6 * len(result["sets"]), 8), layout="constrained")
        draw_sets(result, figure)
        figure.suptitle(
            f"{settings['run']}: held-out windows of {settings['seq']} tokens, buckets of "
            f"{settings['bucket']}"
        )
        return save_png(figure, path)
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    axes = figure.subplots(1, 2)
    draw(result, (axes[0], axes[1]))
    figure.suptitle(
        f"{settings['run']}: {settings['windows']} held-out windows of {settings['seq']} tokens, "
        f"buckets of {settings['bucket']}"
    )
    return save_png(figure, path)


def save_png(figure: Figure, path: Path) -> Path:
    """Write ``figure`` as PNG to ``path`` through a temporary name in the same folder (removed if the write
    fails). `genomelm eval` and `genomelm probe` call this inside `genomelm.eval.report.write_result_set`."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        figure.savefig(tmp, format="png", dpi=120)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def draw_probe(result: dict, axes: tuple[Axes, Axes]) -> None:
    """Draw a `copy_probe.json` result on two axes: the loss gap (baseline - with copy) with its 95% interval
    across windows against the distance between the copies (log scale), and the loss with and without the
    copy."""
    rows = result["distances"]
    x = np.array([r["distance"] for r in rows], dtype=float)
    gap_ax, loss_ax = axes

    def values(model: str, key: str) -> np.ndarray:
        return np.array([np.nan if r[model][key] is None else r[model][key] for r in rows], dtype=float)

    for model, colour in (("before", "tab:gray"), ("after", "tab:blue")):
        gap = values(model, "gap")
        gap_ax.errorbar(
            x,
            gap,
            yerr=np.nan_to_num([gap - values(model, "gap_low"), values(model, "gap_high") - gap]),
            marker="o",
            ms=4,
            capsize=3,
            color=colour,
            label=model,
        )
        loss_ax.plot(x, values(model, "planted"), marker="o", color=colour, label=f"{model}: with the copy")
        loss_ax.plot(
            x, values(model, "baseline"), marker="s", ls="--", color=colour, label=f"{model}: without"
        )
    gap_ax.axhline(0, color="black", lw=0.5)
    settings = result["settings"]
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(x, [seq_label(int(d)) for d in x])
        ax.minorticks_off()
        ax.set_xlabel("distance between the copies (tokens)")
    gap_ax.set_ylabel("loss gap, without - with copy (nats/base)")
    gap_ax.set_title(
        f"retrieval of a {settings['probe_length']}-base copy (bars: 95% intervals across windows)"
    )
    gap_ax.legend()
    loss_ax.set_ylabel("loss on the copied bases (nats/base)")
    loss_ax.set_title("with and without the earlier copy")
    loss_ax.legend(fontsize="small")


def save_probe_figure(result: dict, path: Path) -> Path:
    """Write the copy-probe figure of `result` as PNG to `path` (through a temporary name)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.5), layout="constrained")
    axes = figure.subplots(1, 2)
    draw_probe(result, (axes[0], axes[1]))
    settings = result["settings"]
    windows, seq = settings["windows"], settings["seq"]
    figure.suptitle(f"{settings['run']}: copy probe on {windows} held-out windows of {seq} tokens")
    return save_png(figure, path)
