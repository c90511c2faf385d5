"""Held-out loss grouped by position in the window (numpy only).

Position t of a window is the prediction of token t+1 from the t+1 tokens before it, so a bucket of
positions [start, end) is a band of context lengths. A bucket's loss is the token-weighted mean over its valid
tokens (N and padding excluded) of all windows, and its standard error is that estimator's own: the
linearised error of a ratio of totals across windows, the independent samples (`genomelm.run.uncertainty`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from genomelm.run.uncertainty import Ratio, ratio_estimate

# each bucket row holds these statistics for all valid tokens, and the same with the prefix
# "repeat_" (soft-masked targets) and "unmasked_" (upper-case targets)
STATS = ("loss", "se", "tokens", "windows")
SUBSETS = {"": None, "repeat_": True, "unmasked_": False}


@dataclass
class BucketSums:
    """One model's per-window totals by position bucket: starts, ends int [B] (positions, half-open);
    tokens and sums {subset prefix: [W, B]}: valid tokens (int64) and their loss sum (nats, float64)."""

    starts: np.ndarray
    ends: np.ndarray
    tokens: dict[str, np.ndarray]
    sums: dict[str, np.ndarray]


def bucket_sums(token_loss: np.ndarray, valid: np.ndarray, softmask: np.ndarray, bucket: int) -> BucketSums:
    """Per-window totals of every subset by bucket.

    token_loss: float [W, S] nats per position (any value where not valid); valid: bool [W, S];
    softmask: bool [W, S], True where the predicted base is soft-masked (repeat); bucket: positions per
    bucket (the last one holds the remaining S mod bucket positions when S is not a multiple).
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
    loss64 = token_loss.astype(np.float64)
    tokens, sums = {}, {}
    for prefix, masked in SUBSETS.items():
        keep = valid if masked is None else valid & (softmask == masked)
        sums[prefix] = np.add.reduceat(np.where(keep, loss64, 0.0), starts, axis=1)
        tokens[prefix] = np.add.reduceat(keep.astype(np.int64), starts, axis=1)
    return BucketSums(starts, np.minimum(starts + bucket, width), tokens, sums)


def window_stats(sums: np.ndarray, counts: np.ndarray) -> dict[str, np.ndarray]:
    """Per-column statistics from per-window sums and token counts, both [W, K].

    loss: token-weighted mean (NaN with no tokens); se: its linearised standard error across the windows
    that have tokens (NaN with fewer than 2); tokens; windows: the windows with tokens.
    """
    sums, counts = np.asarray(sums, np.float64), np.asarray(counts)
    estimates = [
        ratio_estimate(Ratio.of(sums[:, k], counts[:, k], counts[:, k])) for k in range(sums.shape[1])
    ]
    return {
        "loss": np.array([e.value for e in estimates]),
        "se": np.array([e.se for e in estimates]),
        "tokens": counts.sum(axis=0),
        "windows": (counts > 0).sum(axis=0),
    }


def loss_rows(sums: BucketSums) -> list[dict]:
    """One dict per bucket: start, end (positions, half-open), loss, se, tokens, windows, and the same four
    with the prefixes repeat_ and unmasked_. Loss is NaN for a bucket without tokens."""
    rows = [{"start": int(s), "end": int(e)} for s, e in zip(sums.starts, sums.ends)]
    for prefix in SUBSETS:
        stats = window_stats(sums.sums[prefix], sums.tokens[prefix])
        for i, row in enumerate(rows):
            row[prefix + "loss"] = float(stats["loss"][i])
            row[prefix + "se"] = float(stats["se"][i])
            row[prefix + "tokens"] = int(stats["tokens"][i])
            row[prefix + "windows"] = int(stats["windows"][i])
    return rows


def bucketed_loss(token_loss: np.ndarray, valid: np.ndarray, softmask: np.ndarray, bucket: int) -> list[dict]:
    """Loss per position bucket (`loss_rows` of `bucket_sums`; the arguments as there)."""
    return loss_rows(bucket_sums(token_loss, valid, softmask, bucket))
