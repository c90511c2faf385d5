"""Held-out loss grouped by position in the window (numpy only).

Position t of a window is the prediction of token t+1 from the t+1 tokens before it, so a bucket of
positions [start, end) is a band of context lengths. Means are over valid tokens (N and padding
excluded); standard errors are across windows, which are the independent samples.
"""

from __future__ import annotations

import math

import numpy as np

# each bucket row holds these statistics for all valid tokens, and the same with the prefix
# "repeat_" (soft-masked targets) and "unmasked_" (upper-case targets)
STATS = ("loss", "se", "tokens", "windows")
SUBSETS = {"": None, "repeat_": True, "unmasked_": False}


def window_stats(sums: np.ndarray, counts: np.ndarray) -> dict[str, np.ndarray]:
    """Per-bucket statistics from per-window sums and token counts, both [W, n_buckets].

    loss: token-weighted mean (NaN with no tokens); se: std (ddof=1) of per-window means over the
    windows that have tokens / sqrt(their number) (NaN with fewer than 2 such windows).
    """
    tokens = counts.sum(axis=0)
    has = counts > 0
    windows = has.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        loss = sums.sum(axis=0) / tokens
        means = np.where(has, sums / np.where(has, counts, 1), np.nan)
        centre = np.nansum(means, axis=0) / windows
        ss = np.nansum((means - centre) ** 2, axis=0)
        se = np.where(windows >= 2, np.sqrt(ss / (windows - 1)) / np.sqrt(windows), np.nan)
    return {"loss": loss, "se": se, "tokens": tokens, "windows": windows}


def bucketed_loss(token_loss: np.ndarray, valid: np.ndarray, softmask: np.ndarray, bucket: int) -> list[dict]:
    """Loss per position bucket.

    token_loss: float [W, S] nats per position (any value where not valid); valid: bool [W, S];
    softmask: bool [W, S], True where the predicted base is soft-masked (repeat); bucket: positions per
    bucket (the last one holds the remaining S mod bucket positions when S is not a multiple).
    Returns one dict per bucket: start, end (positions, half-open), loss, se, tokens, windows, and the
    same four with the prefixes repeat_ and unmasked_. Loss is NaN for a bucket without tokens.
    """
    token_loss, valid, softmask = np.asarray(token_loss), np.asarray(valid, bool), np.asarray(softmask, bool)
    if token_loss.ndim != 2 or token_loss.shape != valid.shape or valid.shape != softmask.shape:
        raise ValueError(
            f"token_loss, valid, softmask must be [W, S] alike: {token_loss.shape}, "
            f"{valid.shape}, {softmask.shape}"
        )
    width = token_loss.shape[1]
    if not 1 <= bucket <= width:
        raise ValueError(f"bucket must be 1..{width} positions (the window length), got {bucket}")
    starts = np.arange(0, width, bucket)
    ends = np.minimum(starts + bucket, width)
    rows = [{"start": int(s), "end": int(e)} for s, e in zip(starts, ends)]
    loss64 = token_loss.astype(np.float64)
    for prefix, masked in SUBSETS.items():
        keep = valid if masked is None else valid & (softmask == masked)
        sums = np.add.reduceat(np.where(keep, loss64, 0.0), starts, axis=1)
        counts = np.add.reduceat(keep.astype(np.int64), starts, axis=1)
        stats = window_stats(sums, counts)
        for i, row in enumerate(rows):
            row[prefix + "loss"] = float(stats["loss"][i])
            row[prefix + "se"] = float(stats["se"][i])
            row[prefix + "tokens"] = int(stats["tokens"][i])
            row[prefix + "windows"] = int(stats["windows"][i])
    return rows


def relative_change(before: float, after: float) -> float:
    """(after - before) / before; NaN when before is 0 or either is NaN."""
    if math.isnan(before) or math.isnan(after) or before == 0:
        return math.nan
    return (after - before) / before


def _pooled(rows: list[dict], prefix: str) -> tuple[float, int]:
    """Token-weighted mean loss and token count over all buckets (= the mean over all valid tokens)."""
    tokens = sum(r[prefix + "tokens"] for r in rows)
    total = sum(r[prefix + "loss"] * r[prefix + "tokens"] for r in rows if r[prefix + "tokens"])
    return (total / tokens if tokens else math.nan), tokens


def compare(before: list[dict], after: list[dict]) -> dict:
    """Relative change per bucket and overall, for rows of `bucketed_loss` on the same windows.

    Returns {"buckets": [{start, end, before: row, after: row, change, repeat_change, unmasked_change}],
    "overall": {loss_before, loss_after, change, tokens, and the same per subset prefix}}.
    """
    if [(r["start"], r["end"]) for r in before] != [(r["start"], r["end"]) for r in after]:
        raise ValueError(
            "before and after rows cover different buckets; score both with the same bucket size"
        )
    buckets = []
    for b, a in zip(before, after):
        row = {"start": b["start"], "end": b["end"], "before": b, "after": a}
        for prefix in SUBSETS:
            row[prefix + "change"] = relative_change(b[prefix + "loss"], a[prefix + "loss"])
        buckets.append(row)
    overall: dict = {}
    for prefix in SUBSETS:
        loss_before, tokens = _pooled(before, prefix)
        loss_after, _ = _pooled(after, prefix)
        overall[prefix + "loss_before"] = loss_before
        overall[prefix + "loss_after"] = loss_after
        overall[prefix + "change"] = relative_change(loss_before, loss_after)
        overall[prefix + "tokens"] = tokens
    return {"buckets": buckets, "overall": overall}
