"""`genomelm probe CONFIG [key=value ...] [--before PATH] [--after PATH]`: how far back the model finds a
copy.

In each probed held-out window the last L = `probe_length` real bases, the *target* [T, T + L), are copied
over the bases [T - d, T - d + L) for each distance d of `probe_distances` (the *planted* window). The model
scores the target in the planted window and in the original window (the *baseline*, which keeps its own bases
at [T - d, T - d + L)): the same real bases at the same place, with and without a copy d tokens earlier. The
gap, baseline loss - planted loss in nats per base, over the target's bases after its first (nothing before
the first says that a copy begins), shows how far back the model retrieves. Distances with d < L (the copies
would overlap) or d > T (no room before the target) are skipped and reported. Writes
`results/<run>/copy_probe.json`, `copy_probe.csv` and `copy_probe.png`, before and after training. With dp, cp
or ep above 1 it runs on the run's mesh as `genomelm eval` does (the dp replicas split the forward passes).
"""

from __future__ import annotations

import csv
import functools
import io
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from genomelm.data.errors import DataError
from genomelm.data.regions import parse_seq
from genomelm.data.tokens import unpadded_length
from genomelm.data.vocab import IGNORE_INDEX
from genomelm.data.windows import Window
from genomelm.eval.buckets import window_stats
from genomelm.eval.evaluate import load_heldout
from genomelm.eval.plot import save_probe_figure
from genomelm.eval.report import format_number, jsonable, write_atomic, write_result_set
from genomelm.eval.table import MARK, with_interval
from genomelm.run.config import TrainConfig
from genomelm.run.scoring import (
    ScoringRun,
    WindowShare,
    load_scoring_model,
    progress_bar,
    scoring_source,
    token_losses,
)
from genomelm.run.uncertainty import Estimate, Ratio, combine, ratio_estimate

if TYPE_CHECKING:
    from genomelm.eval.evaluate import HeldoutSet

MODELS = ("before", "after")
CURVES = ("planted", "baseline", "gap")  # per model and distance: loss with the copy, without it, and the gap


class ProbeError(Exception):
    """Bad probe settings or inputs; the message says how to fix them."""

    exit_code = 2  # the user's input (`genomelm.run.failures`)


def parse_distances(text: str) -> list[int]:
    """``"1k,4k,16k"`` -> [1024, 4096, 16384] (tokens, sorted, without repeats)."""
    distances = set()
    for item in str(text).split(","):
        try:
            distances.add(parse_seq(item))
        except DataError:
            raise ProbeError(
                f"probe_distances={text!r}: {item.strip()!r} is not a distance; give positive "
                "token counts such as 1k,4k,16k,64k,256k,1M"
            ) from None
    return sorted(distances)


@dataclass(frozen=True)
class ProbeSite:
    """One probe in a window: the target [target, target + length) and its planted copy ``distance``
    earlier."""

    target: int
    distance: int
    length: int

    @property
    def source(self) -> int:
        """First position of the planted copy."""
        return self.target - self.distance

    @property
    def scored(self) -> slice:
        """Loss positions scored: those predicting the target's bases after its first (position t predicts
        token t + 1), [target, target + length - 1)."""
        return slice(self.target, self.target + self.length - 1)


def probe_sites(
    real_length: int, length: int, distances: Sequence[int]
) -> tuple[list[ProbeSite], list[dict]]:
    """Sites of a window with ``real_length`` bases before its padding, and the skipped distances with why."""
    if length < 2:
        raise ProbeError(
            f"probe_length={length}: give at least 2 bases (the first base of a copy is not scored)"
        )
    target = real_length - length
    sites, skipped = [], []
    for d in distances:
        if d < length:
            skipped.append(
                {"distance": d, "reason": f"shorter than probe_length={length}: the copies would overlap"}
            )
        elif d > target:
            skipped.append(
                {
                    "distance": d,
                    "reason": f"does not fit: in a window of {real_length:,} bases, "
                    f"copies of {length} bases are at most {max(target, 0):,} apart",
                }
            )
        else:
            sites.append(ProbeSite(target, d, length))
    return sites, skipped


def plant(window: Window, site: ProbeSite) -> Window:
    """The window with its target copied to ``site.source`` (labels follow the new ids); ``window`` is not
    modified."""
    ids = window.ids.clone()
    ids[site.source : site.source + site.length] = window.ids[site.target : site.target + site.length]
    return window.with_ids(ids)


@dataclass
class ProbeScores:
    """Summed target loss [W, D] (nats) of W windows at D distances, planted and baseline, and the number of
    scored bases [W, D] (0 where a distance does not fit the window or every target base is N)."""

    planted: np.ndarray
    baseline: np.ndarray
    tokens: np.ndarray


def score_probe(
    model: torch.nn.Module,
    windows: Sequence[Window],
    length: int,
    distances: Sequence[int],
    precision: str = "auto",
    progress: bool = False,
    share: WindowShare | None = None,
) -> ProbeScores:
    """Score the probe of every window at every distance with ``model``: one forward pass of the original
    window, and one per distance that fits. With `share` the dp replicas split the passes (all of one window's
    length, so every replica runs the same passes), the sums gathered on every rank."""
    shape = (len(windows), len(distances))
    scores = ProbeScores(np.zeros(shape), np.zeros(shape), np.zeros(shape, dtype=np.int64))
    column = {d: j for j, d in enumerate(distances)}

    def scored(window: Window, site: ProbeSite) -> np.ndarray:
        """Which of the site's scored positions predict a real base (the same in the planted window)."""
        return (window.labels[site.scored] != IGNORE_INDEX).numpy()

    def baseline(w: int, sites: list[ProbeSite]) -> list[tuple[str, int, int, float]]:
        losses = token_losses(model, windows[w], precision)
        return [
            ("baseline", w, column[site.distance], float(losses[site.scored][scored(windows[w], site)].sum()))
            for site in sites
        ]

    def planted(w: int, site: ProbeSite) -> list[tuple[str, int, int, float]]:
        losses = token_losses(model, plant(windows[w], site), precision)
        return [
            ("planted", w, column[site.distance], float(losses[site.scored][scored(windows[w], site)].sum()))
        ]

    jobs: list[Callable[[], list[tuple[str, int, int, float]]]] = []
    for w in range(len(windows)):
        window = windows[w]
        sites, _ = probe_sites(unpadded_length(window.input_ids, window.vocab), length, distances)
        if sites:
            jobs.append(functools.partial(baseline, w, sites))
        for site in sites:
            jobs.append(functools.partial(planted, w, site))
            scores.tokens[w, column[site.distance]] = scored(window, site).sum()

    model.eval()
    with torch.no_grad():
        results = (share or WindowShare()).run(jobs, progress_bar("probe", "pass") if progress else None)
    for name, w, j, total in (item for result in results for item in result):
        getattr(scores, name)[w, j] = total
    return scores


def summarise(scores: ProbeScores) -> dict[str, dict[str, np.ndarray]]:
    """Per distance [D]: planted and baseline loss and their gap (token-weighted means over windows, nats per
    base), each with its standard error across windows, and the tokens and windows scored."""
    out = {}
    for name, sums in (
        ("planted", scores.planted),
        ("baseline", scores.baseline),
        ("gap", scores.baseline - scores.planted),
    ):
        out[name] = window_stats(sums, scores.tokens)
    return out


def gap_ratio(scores: ProbeScores, j: int) -> Ratio:
    """The j-th distance's gap as a ratio over the windows: their summed gap over their scored bases."""
    tokens = scores.tokens[:, j]
    return Ratio.of(scores.baseline[:, j] - scores.planted[:, j], tokens, tokens)


def gap_estimates(scores: dict[str, ProbeScores], j: int) -> dict[str, Estimate]:
    """The j-th distance's gap of each model and the change after - before, with 95% intervals across the
    windows; the change is paired, as both models score the same bases of the same windows
    (`genomelm.run.uncertainty`)."""
    out = {name: ratio_estimate(gap_ratio(scores[name], j)) for name in MODELS}
    out["change"] = combine([(1.0, gap_ratio(scores["after"], j)), (-1.0, gap_ratio(scores["before"], j))])
    return out


def run_probe(
    config: TrainConfig,
    heldout: HeldoutSet,
    load: Callable[[str], torch.nn.Module],
    before: str,
    after: str,
    share: WindowShare | None = None,
) -> dict:
    """The copy probe of the held-out windows with the models ``load(before)`` and ``load(after)``; `share`:
    the dp replicas splitting the passes. What the writers take."""
    windows = heldout.windows
    if not len(windows):
        raise ProbeError("no held-out windows to probe")
    requested = parse_distances(config.probe.probe_distances)
    vocab = windows[0].vocab  # one vocabulary per prepared folder
    lengths = [unpadded_length(windows[i].input_ids, vocab) for i in range(len(windows))]
    longest = max(lengths)
    sites, skipped = probe_sites(longest, config.probe.probe_length, requested)
    distances = [site.distance for site in sites]
    if not distances:
        length = config.probe.probe_length
        raise ProbeError(
            f"no distance of probe_distances={config.probe.probe_distances} fits windows of "
            f"{longest:,} bases with probe_length={length}: give distances from {length} to "
            f"{longest - length}"
        )
    for item in skipped:
        print(f"distance {item['distance']:,} skipped: {item['reason']}")
    summaries, all_scores = {}, {}
    for name, path in (("before", before), ("after", after)):
        began = time.perf_counter()
        print(
            f"probing {len(windows)} window(s) at {len(distances)} distance(s) with the {name} model {path}",
            flush=True,
        )
        model = load(path)
        scores = score_probe(
            model,
            windows,
            config.probe.probe_length,
            distances,
            config.memory.precision,
            progress=True,
            share=share,
        )
        del model
        summaries[name], all_scores[name] = summarise(scores), scores
        print(f"  {time.perf_counter() - began:.1f} s", flush=True)
    rows = [distance_row(summaries, gap_estimates(all_scores, j), j, d) for j, d in enumerate(distances)]
    settings = {
        "run": config.run,
        "seq": len(windows[0].input_ids),
        "probe_length": config.probe.probe_length,
        "scored_bases": config.probe.probe_length - 1,
        "probe_distances": config.probe.probe_distances,
        "distances": distances,
        "skipped": skipped,
        "windows": len(windows),
        "probe_windows": config.probe.probe_windows,
        "targets": [n - config.probe.probe_length for n in lengths],  # first position of each window's target
    }
    timestamp = datetime.now(UTC).isoformat(timespec="seconds")
    models = {"before_model": before, "after_model": after}
    return {
        "settings": settings,
        "distances": rows,
        "provenance": {**models, **heldout.provenance, "timestamp": timestamp},
    }


def distance_row(summaries: dict[str, dict], gaps: dict[str, Estimate], j: int, distance: int) -> dict:
    """The result row of the j-th distance: windows and tokens scored, each model's curves with their
    standard errors and its gap's 95% interval, and the paired change of the gap after - before."""
    row: dict = {
        "distance": distance,
        "windows": int(summaries["after"]["gap"]["windows"][j]),
        "tokens": int(summaries["after"]["gap"]["tokens"][j]),
    }
    for name in MODELS:
        stats = summaries[name]
        row[name] = {
            f"{curve}{suffix}": float(stats[curve][key][j])
            for curve in CURVES
            for suffix, key in (("", "loss"), ("_se", "se"))
        }
        row[name].update(
            gap_low=gaps[name].low, gap_high=gaps[name].high, gap_excludes_zero=gaps[name].excludes_zero
        )
    row["gap_change"] = gaps["change"].as_dict()
    return row


def csv_columns() -> list[str]:
    per_model = [f"{curve}{suffix}" for curve in CURVES for suffix in ("", "_se")] + [
        "gap_low",
        "gap_high",
        "gap_excludes_zero",
    ]
    return (
        ["distance", "windows", "tokens"]
        + [f"{name}_{column}" for name in MODELS for column in per_model]
        + ["gap_change", "gap_change_low", "gap_change_high"]
    )


def write_probe_csv(result: dict, path: Path) -> Path:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=csv_columns(), lineterminator="\n")
    writer.writeheader()
    for row in jsonable(result["distances"]):
        flat = {"distance": row["distance"], "windows": row["windows"], "tokens": row["tokens"]}
        flat.update({f"{name}_{key}": value for name in MODELS for key, value in row[name].items()})
        change = row["gap_change"]
        flat.update(gap_change=change["value"], gap_change_low=change["low"], gap_change_high=change["high"])
        writer.writerow({k: "" if v is None else v for k, v in flat.items()})
    return write_atomic(path, out.getvalue())


def write_probe_outputs(result: dict, folder: Path) -> dict[str, Path]:
    """Write copy_probe.json, copy_probe.csv and copy_probe.png into ``folder`` (created if needed) as one
    set, `genomelm.eval.report.write_result_set`'s set "copy_probe": readers see the previous three files or
    the new three, never a mix, and a failure (WriteError for a full disk) leaves the previous ones. Eval's
    files in the same folder are not touched."""
    text = json.dumps(jsonable(result), indent=2, allow_nan=False) + "\n"
    paths = write_result_set(
        folder,
        "copy_probe",
        {
            "copy_probe.json": lambda path: write_atomic(path, text),
            "copy_probe.csv": lambda path: write_probe_csv(result, path),
            "copy_probe.png": lambda path: save_probe_figure(result, path),
        },
    )
    return {
        "json": paths["copy_probe.json"],
        "csv": paths["copy_probe.csv"],
        "figure": paths["copy_probe.png"],
    }


def format_probe_table(result: dict) -> str:
    """One line per distance: windows, scored bases, per model the planted and baseline loss and the gap
    with its 95% interval, and the gap's change after - before with its paired interval."""
    header = (
        f"{'distance':>9} {'windows':>7} {'tokens':>7}"
        + "".join(f" | {name + ': copy':>12} {'base':>7} {'gap (nats/base)':>22}" for name in MODELS)
        + f" | {'change of the gap':>22}"
    )
    lines = [header, "-" * len(header)]
    for row in result["distances"]:
        cells = [f"{row['distance']:>9,} {row['windows']:>7} {row['tokens']:>7}"]
        for name in MODELS:
            r = row[name]
            gap = {"value": r["gap"], "low": r["gap_low"], "high": r["gap_high"]}
            gap["excludes_zero"] = r["gap_excludes_zero"]
            cells.append(
                f"{format_number(r['planted'], '.4f'):>12} {format_number(r['baseline'], '.4f'):>7} "
                f"{with_interval(gap, scale=1.0, digits=4, unit='', column=True):>22}"
            )
        change = with_interval(row["gap_change"], scale=1.0, digits=4, unit="", column=True)
        lines.append(" | ".join([*cells, f"{change:>22}"]))
    lines.append(
        f"(nats/base over the {result['settings']['scored_bases']} bases after the first of each "
        f"{result['settings']['probe_length']}-base copy; gap = baseline - copy; ± : 95% interval across "
        f"windows (Student t), the change paired; {MARK} : it excludes 0)"
    )
    lines += [f"skipped {item['distance']:,}: {item['reason']}" for item in result["settings"]["skipped"]]
    return "\n".join(lines)


def probe_config(config: TrainConfig, before: str, after: str) -> dict:
    """`genomelm probe`'s result: the run's held-out windows probed with the models `before` and `after`."""
    heldout = load_heldout(config.data_dir, config.probe.probe_windows)
    run = ScoringRun.from_environment(config)
    load = functools.partial(load_scoring_model, config=config, run=run)
    before, after = scoring_source(before, run), scoring_source(after, run)
    return run_probe(config, heldout, load, before, after, run.share)
