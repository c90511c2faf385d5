"""The loss-by-position figure: loss per bucket before/after training, and its relative change."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure


def context_kb(buckets: list[dict]) -> np.ndarray:
    """Bucket midpoints in kb (1000 tokens) of context: [n_buckets]."""
    return np.array([(b["start"] + b["end"]) / 2 / 1000 for b in buckets])


def draw(result: dict, axes: tuple[Axes, Axes]) -> None:
    """Draw a `buckets.json` result on two axes: loss +- s.e. before/after, and the change in %."""
    buckets = result["buckets"]
    x = context_kb(buckets)
    widths = np.array([0.8 * (b["end"] - b["start"]) / 1000 for b in buckets])
    loss_ax, change_ax = axes
    for key, colour in (("before", "tab:gray"), ("after", "tab:blue")):
        loss = np.array([np.nan if b[key]["loss"] is None else b[key]["loss"] for b in buckets], dtype=float)
        se = np.array([np.nan if b[key]["se"] is None else b[key]["se"] for b in buckets], dtype=float)
        loss_ax.errorbar(x, loss, yerr=np.nan_to_num(se), marker="o", ms=3, capsize=3, color=colour, label=key)
    loss_ax.set_xlabel("context (kb, bucket midpoint)")
    loss_ax.set_ylabel("held-out loss (nats/base)")
    loss_ax.set_title("loss by position (error bars: s.e. across windows)")
    loss_ax.legend()
    change = np.array([np.nan if b["change"] is None else 100 * b["change"] for b in buckets], dtype=float)
    colours = ["tab:green" if c < 0 else "tab:red" for c in np.nan_to_num(change)]
    change_ax.bar(x, np.nan_to_num(change), width=widths, color=colours)
    overall = result["overall"]["change"]
    if overall is not None:
        change_ax.axhline(100 * overall, color="black", ls="--", lw=1, label=f"overall {100 * overall:+.2f}%")
        change_ax.legend()
    change_ax.axhline(0, color="black", lw=0.5)
    change_ax.set_xlabel("context (kb, bucket midpoint)")
    change_ax.set_ylabel("relative change after vs before (%)")
    change_ax.set_title("(after - before) / before per bucket")


def save_figure(result: dict, path: Path) -> Path:
    """Write the two-panel figure of `result` as PNG to `path` (through a temporary name)."""
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    axes = figure.subplots(1, 2)
    draw(result, (axes[0], axes[1]))
    settings = result["settings"]
    figure.suptitle(f"{settings['run']}: {settings['windows']} held-out windows of {settings['seq']} tokens, "
                    f"buckets of {settings['bucket']}")  # fmt: skip
    tmp = path.with_name(path.name + ".tmp")
    figure.savefig(tmp, format="png", dpi=120)
    os.replace(tmp, path)
    return path
