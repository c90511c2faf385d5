"""The before/after comparison of one held-out set, every number with its paired 95% interval (numpy only).

Both models score the same windows and tokens, so each comparison is a function of per-window totals
(`WindowSums`) and its error is paired by window (`genomelm.run.uncertainty`). Per bucket and overall, for
all valid tokens and the soft-masked (repeat_) and upper-case (unmasked_) subsets:

    change       (after - before) / before = sum(after) / sum(before) - 1      (relative)
    change_nats  (sum(after) - sum(before)) / tokens                           (nats per base)

The context cut (the last bucket scored again with only the bucket before it as context), per model: the
cut's relative change over full context and the long-context gain (cut - full) / tokens in nats; and the
gain's change after vs before (positive: training made the model use far context more). The contrast "is the
gain larger late than early": the last bucket's relative change minus the first's, and the least-squares
slope of the buckets' relative changes against log2 of the bucket's midpoint position (change per doubling
of context).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from genomelm.eval.buckets import SUBSETS, BucketSums, loss_rows
from genomelm.run.uncertainty import Estimate, Ratio, combine, ratio_estimate, slope_weights


@dataclass
class WindowSums:
    """The per-window facts one held-out set's table is computed from: `before` and `after` (the same
    windows, buckets and tokens), and the last bucket's loss sums with its context cut, float [W] per model
    (None without the cut), whose context is `cut_context` tokens."""

    before: BucketSums
    after: BucketSums
    cut_before: np.ndarray | None = None
    cut_after: np.ndarray | None = None
    cut_context: int = 0

    def __post_init__(self) -> None:
        same = np.array_equal(self.before.starts, self.after.starts) and np.array_equal(
            self.before.ends, self.after.ends
        )
        if not same:
            raise ValueError("before and after cover different buckets; score both with the same bucket size")
        if any(not np.array_equal(self.before.tokens[p], self.after.tokens[p]) for p in SUBSETS):
            raise ValueError("before and after were scored on different tokens; score the same windows")

    @property
    def tokens(self) -> dict[str, np.ndarray]:
        return self.before.tokens


def _change(before: np.ndarray, after: np.ndarray, tokens: np.ndarray) -> Estimate:
    return ratio_estimate(Ratio.of(after, before, tokens), offset=-1.0)


def _change_nats(before: np.ndarray, after: np.ndarray, tokens: np.ndarray) -> Estimate:
    return ratio_estimate(Ratio.of(after - before, tokens, tokens))


def _per_window(totals: np.ndarray, column: int | None) -> np.ndarray:
    """[W, B] totals of one bucket (`column`) or of all buckets (None): [W]."""
    return totals[:, column] if column is not None else totals.sum(axis=1)


def _changes(sums: WindowSums, column: int | None) -> dict[str, Estimate]:
    """Paired changes of one bucket (`column`) or of all buckets (None), for every subset."""
    out = {}
    for prefix in SUBSETS:
        before = _per_window(sums.before.sums[prefix], column)
        after = _per_window(sums.after.sums[prefix], column)
        tokens = _per_window(sums.tokens[prefix], column)
        out[prefix + "change"] = _change(before, after, tokens)
        out[prefix + "change_nats"] = _change_nats(before, after, tokens)
    return out


def _intervals(estimates: dict[str, Estimate]) -> dict[str, dict]:
    return {name: estimate.as_dict() for name, estimate in estimates.items()}


def bucket_rows(sums: WindowSums) -> list[dict]:
    """Per bucket: start, end, the models' loss rows ("before", "after": `loss_rows`), each subset's change
    and change_nats, and "intervals" {name: `Estimate.as_dict()`} for those."""
    rows = []
    for i, (b, a) in enumerate(zip(loss_rows(sums.before), loss_rows(sums.after))):
        changes = _changes(sums, i)
        row = {"start": b["start"], "end": b["end"], "before": b, "after": a}
        row |= {name: estimate.value for name, estimate in changes.items()}
        rows.append(row | {"intervals": _intervals(changes)})
    return rows


def overall(sums: WindowSums) -> dict:
    """Over all buckets, per subset prefix: loss_before, loss_after (token-weighted means) with their standard
    errors (loss_before_se, loss_after_se), tokens, windows, change, change_nats; and "intervals"."""
    out: dict = {}
    for prefix in SUBSETS:
        tokens = sums.tokens[prefix].sum(axis=1)
        for model, bucketed in (("before", sums.before), ("after", sums.after)):
            loss = ratio_estimate(Ratio.of(bucketed.sums[prefix].sum(axis=1), tokens, tokens))
            out[f"{prefix}loss_{model}"] = loss.value
            out[f"{prefix}loss_{model}_se"] = loss.se
        out[prefix + "tokens"] = int(tokens.sum())
        out[prefix + "windows"] = int((tokens > 0).sum())
    changes = _changes(sums, None)
    out |= {name: estimate.value for name, estimate in changes.items()}
    return out | {"intervals": _intervals(changes)}


def context_cut(sums: WindowSums) -> dict | None:
    """The last bucket with full context vs with its context cut, per model, and the gain's change after vs
    before; None without the cut. Keys as `genomelm.eval.report.format_table` reads them, plus "intervals"."""
    if sums.cut_before is None or sums.cut_after is None:
        return None
    tokens = sums.tokens[""][:, -1]
    out: dict = {"start": int(sums.before.starts[-1]), "end": int(sums.before.ends[-1])}
    out["context"] = sums.cut_context
    estimates: dict[str, Estimate] = {}
    full_sums = {"before": sums.before.sums[""][:, -1], "after": sums.after.sums[""][:, -1]}
    cut_sums = {"before": sums.cut_before, "after": sums.cut_after}
    for model in ("before", "after"):
        full = ratio_estimate(Ratio.of(full_sums[model], tokens, tokens))
        cut = ratio_estimate(Ratio.of(cut_sums[model], tokens, tokens))
        estimates[f"{model}_cut_change"] = _change(full_sums[model], cut_sums[model], tokens)
        estimates[f"{model}_gain_nats"] = _change_nats(full_sums[model], cut_sums[model], tokens)
        out[model] = {
            "full": full.value,
            "full_se": full.se,
            "cut": cut.value,
            "cut_se": cut.se,
            "cut_change": estimates[f"{model}_cut_change"].value,
            "gain_nats": estimates[f"{model}_gain_nats"].value,
        }
    estimates["change_full"] = _change(full_sums["before"], full_sums["after"], tokens)
    estimates["change_cut"] = _change(cut_sums["before"], cut_sums["after"], tokens)
    gain = {model: cut_sums[model] - full_sums[model] for model in cut_sums}
    estimates["gain_change_nats"] = ratio_estimate(Ratio.of(gain["after"] - gain["before"], tokens, tokens))
    for name in ("change_full", "change_cut", "gain_change_nats"):
        out[name] = estimates[name].value
    return out | {"intervals": _intervals(estimates)}


def contrast(sums: WindowSums) -> dict:
    """Is the change larger late than early: late_minus_early (the last bucket's relative change minus the
    first's) and slope_per_doubling (least-squares slope of the buckets' relative changes against log2 of
    their midpoint positions), as `Estimate.as_dict()`, with the buckets they use."""
    tokens = sums.tokens[""]
    after, before = sums.after.sums[""], sums.before.sums[""]
    ratios = [Ratio.of(after[:, i], before[:, i], tokens[:, i]) for i in range(tokens.shape[1])]
    used = [i for i in range(len(ratios)) if tokens[:, i].sum() > 0]
    windows = int((tokens.sum(axis=1) > 0).sum())
    if len(ratios) < 2:
        late = Estimate.unavailable(windows, "1 bucket")
    else:
        late = combine([(1.0, ratios[-1]), (-1.0, ratios[0])])
    if len(used) < 2:
        slope = Estimate.unavailable(windows, "fewer than 2 buckets with tokens")
    else:
        weights = slope_weights(np.log2((sums.before.starts[used] + sums.before.ends[used]) / 2))
        slope = combine([(float(w), ratios[i]) for w, i in zip(weights, used)])
    return {
        "late_minus_early": late.as_dict(),
        "first_bucket": 0,
        "last_bucket": len(ratios) - 1,
        "slope_per_doubling": slope.as_dict(),
        "slope_buckets": len(used),
    }


def summarise(sums: WindowSums) -> dict:
    """The comparison of one held-out set: buckets, overall, context_cut (or None) and contrast."""
    return {
        "buckets": bucket_rows(sums),
        "overall": overall(sums),
        "context_cut": context_cut(sums),
        "contrast": contrast(sums),
    }
